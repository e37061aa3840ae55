"""The one exception tree of trainrec.

::

    TrainrecError
     +-- FormatError            a log or run on disk is not what it should be
     |    +-- NotALogError      the file does not start with trainrec's magic
     |    +-- UnsupportedVersionError   written by a format version this reader cannot read
     |    +-- CorruptRecordError        a frame passed its CRC but its payload does not decode
     |    +-- NotARunError      a path is not an output directory, rank directory or log file
     +-- ConfigError            a monitor config or argument is invalid (names it and what was expected)
     +-- WriterError            the background writer failed (disk full, file removed, ...)

Every message says what is wrong and where: a path and byte offset for logs, a key for configs, the
argument for a function's arguments, the option for the tools' command lines.
"""

from __future__ import annotations


class TrainrecError(Exception):
    """Base of every error trainrec raises on purpose."""


class FormatError(TrainrecError):
    """A log file or run directory is malformed."""

    def __init__(self, message: str, path: str | None = None, offset: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}"
            if offset is not None:
                where += f" at byte {offset}"
            where += ": "
        super().__init__(where + message)
        self.message = message  # what is wrong, without where
        self.path = path
        self.offset = offset


class NotALogError(FormatError):
    """The file does not start with the trainrec log magic."""


class UnsupportedVersionError(FormatError):
    """The file was written with a format version this reader does not know."""


class CorruptRecordError(FormatError):
    """A frame's checksum matched but its payload is not a valid record of a known type."""


class NotARunError(FormatError):
    """A path given as RUN is neither an output directory, a rank directory nor a log file."""


class ConfigError(TrainrecError):
    """A monitor configuration, or an argument of the monitor's API, is invalid. ``key`` names the config
    key, the command-line option (``-`` first), or with ``argument=True`` the argument."""

    def __init__(self, message: str, key: str | None = None, source: str | None = None, *,
                 argument: bool = False) -> None:
        prefix = ""
        if source:
            prefix += f"{source}: "
        if key and argument:
            prefix += f"argument {key!r}: "
        elif key and key.startswith("-"):  # a command-line option of the tools
            prefix += f"option {key}: "
        elif key:
            prefix += f"config key {key!r}: "
        super().__init__(prefix + message)
        self.message = message
        self.key = key
        self.source = source
        self.argument = argument

    def with_source(self, source: str | None) -> ConfigError:
        """The same error naming ``source`` (the config file), unless it names one already."""
        if self.source or not source:
            return self
        return ConfigError(self.message, self.key, source, argument=self.argument)


class WriterError(TrainrecError):
    """The background log writer failed; raised on the caller's next call."""
