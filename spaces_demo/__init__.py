"""deltasync's live demo: the page, the FastAPI app that serves it, and the toy trainer/follower.

``deltasync demo`` runs :func:`spaces_demo.app.run_demo`; an HF Space runs the same command.
"""

from spaces_demo.app import create_app, run_demo
from spaces_demo.live import DemoOptions, DemoRun

__all__ = ["DemoOptions", "DemoRun", "create_app", "run_demo"]
