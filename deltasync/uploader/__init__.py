"""Trainer side: :class:`DeltaUploader` and its config and results."""

from deltasync.uploader._uploader import CommitInfo, DeltaUploader, UploaderConfig

__all__ = ["CommitInfo", "DeltaUploader", "UploaderConfig"]
