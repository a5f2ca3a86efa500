"""The node's one host mirror of a run: versions in shared memory (``versions``), the folder, lock and
index of the node (``mirror``: :class:`~deltasync.serving.node.mirror.NodeMirror`), built once per node
and step (``_build``) by the node's leader process (``leader``), reached over a Unix socket (``_link``).
Imports nothing itself."""
