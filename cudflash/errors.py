"""Exceptions a user can cause. The CLI prints `cudflash: error: <message>` for these and exits 2."""


class CudflashError(Exception):
    """Base class: a one-line message naming the file / tensor / field and what was expected."""


class ConfigError(CudflashError):
    pass


class CheckpointError(CudflashError):
    pass


class RequestError(CudflashError):
    pass


class BackendError(CudflashError):
    pass
