"""Checks shared by the bad-input tests: an entry point given bad input exits non-zero with one line naming
what is wrong, prints no traceback, and leaves every file that existed before it ran byte-identical."""
import contextlib
import io
import traceback
from collections.abc import Callable
from pathlib import Path


def snapshot(*roots: Path) -> dict[Path, bytes]:
    """The bytes of every file under ``roots`` (a root may itself be a file)."""
    files: dict[Path, bytes] = {}
    for root in map(Path, roots):
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in paths:
            files[path] = path.read_bytes()
    return files


def assert_unchanged(before: dict[Path, bytes]) -> None:
    """Every file of ``before`` still exists with the same bytes (files created since are allowed)."""
    missing = [str(p) for p in before if not p.is_file()]
    changed = [str(p) for p, data in before.items() if p.is_file() and p.read_bytes() != data]
    assert not missing and not changed, f"removed: {missing}; changed: {changed}"


def run_entry_point(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    """Call ``main(argv)`` in this process; return its exit status and what it wrote to stdout and stderr.

    An exception escaping ``main`` is what a user would see as a traceback: it fails the check here.
    """
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception:  # noqa: BLE001 - the point of the check
        raise AssertionError(f"{getattr(main, '__module__', main)} raised instead of exiting with one line:\n"
                             f"{traceback.format_exc()}") from None
    text = out.getvalue()
    assert "Traceback" not in text, text[-3000:]
    return code, text


def assert_one_line_error(main: Callable[[list[str]], int], argv: list[str], *needles: str,
                          unchanged: dict[Path, bytes] | None = None) -> str:
    """``main(argv)`` exits non-zero, prints no traceback, its last ``error:`` line holds every needle, and the
    files of ``unchanged`` (a snapshot) are byte-identical afterwards. Returns that error line."""
    code, text = run_entry_point(main, argv)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code != 0, f"exit 0 for {argv}:\n{text[-3000:]}"
    assert errors, f"no 'error:' line:\n{text[-3000:]}"
    for needle in needles:
        assert needle in errors[-1], f"{needle!r} not in {errors[-1]!r}"
    if unchanged is not None:
        assert_unchanged(unchanged)
    return errors[-1]


def calls_of_two_arriving_together(monkeypatch, cls: type, method: str, fetch: Callable[[], object]) -> tuple[
        list[str], dict[str, object]]:
    """Run ``fetch`` in two threads standing for two processes of a node (each file lock they take is their own):
    the second asks for the cache lock while the first, holding it, is inside ``cls.method``. Returns the threads
    that called ``cls.method``, in order, and what ``fetch`` returned in each thread ("first", "second")."""
    import fcntl
    import threading

    from torchtitan import cache

    calls, first_inside, second_waits = [], threading.Event(), threading.Event()
    real_method, real_flock = getattr(cls, method), fcntl.flock

    def counted(self, *args, **kwargs):
        calls.append(threading.current_thread().name)
        if threading.current_thread().name == "first":  # holds the lock until the second is waiting for it
            first_inside.set()
            assert second_waits.wait(30)
        return real_method(self, *args, **kwargs)

    def flock(file, operation):
        try:
            return real_flock(file, operation)
        except BlockingIOError:
            if threading.current_thread().name == "second":
                second_waits.set()
            raise

    monkeypatch.setattr(cls, method, counted)
    monkeypatch.setattr(cache.fcntl, "flock", flock)
    results = {}

    def run():
        results[threading.current_thread().name] = fetch()

    first = threading.Thread(target=run, name="first")
    first.start()
    assert first_inside.wait(30)
    second = threading.Thread(target=run, name="second")
    second.start()
    first.join(30)
    second.join(30)
    return calls, results
