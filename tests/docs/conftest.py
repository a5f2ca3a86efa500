"""The docs' promises checked against the code: the demo figures the README and docs/ print
(``spaces_demo.figures``, ``scripts/figures.py``) and the install lines the README prints, resolved
by pip as written.

No fixture is shared by more than one module here: each module keeps its own. No root fixture is
used; no helper module.
"""

from __future__ import annotations
