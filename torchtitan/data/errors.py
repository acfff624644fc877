"""The error raised for unusable input data."""


class DataError(Exception):
    """Bad input data (unreadable file, non-text row, missing column); the message is one line naming where."""

    @classmethod
    def from_worker(cls, error: "DataError") -> "DataError":
        """The original error of one raised in a dataloader worker and re-raised by torch in this process.

        torch re-raises a worker's exception with the worker's traceback as its message; the original
        one-line message is the traceback's last line.
        """
        text = str(error).strip()
        last_line = text.splitlines()[-1] if text else ""
        if "Original Traceback" not in text or f"{cls.__name__}: " not in last_line:
            return error
        return cls(last_line.split(f"{cls.__name__}: ", 1)[1])
