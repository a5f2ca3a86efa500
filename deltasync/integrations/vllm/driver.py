"""The HTTP driver of vLLM servers, under the name it had before it moved to :mod:`deltasync.serving.driver`."""

from deltasync.serving.driver import DriverOptions, FleetReporting, PauseMode, ServerUpdate, VLLMDriver, VLLMServer

__all__ = ["DriverOptions", "FleetReporting", "PauseMode", "ServerUpdate", "VLLMDriver", "VLLMServer"]
