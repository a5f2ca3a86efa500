"""The node's one host mirror of a run: versions in shared memory (``versions``), their folder
(``store``: :class:`~deltasync.serving.node.store.VersionStore`), the node lock and its users (``lock``),
one worker's handle on it (``mirror``: :class:`~deltasync.serving.node.mirror.NodeMirror`), versions built
once per node and step (``_build``) by the node's leader process (``leader``), reached over a Unix
socket (``_link``). Imports nothing itself."""
