"""Runs a solution against assert statements; imported by the sandbox child (stdlib only)."""

from __future__ import annotations


def check(code: str, tests: list[str]) -> str:
    """Executes `code`, then each assert of `tests` in its namespace; returns a report
    whose first line is "passed K/N" (an error in the code itself fails every test)."""
    namespace: dict = {"__name__": "solution"}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001 - reported to the model
        return f"passed 0/{len(tests)}\nthe code failed to run: {type(e).__name__}: {e}"
    lines, passed = [], 0
    for test in tests:
        try:
            exec(compile(test, "test.py", "exec"), dict(namespace))
            passed += 1
            lines.append(f"ok    {test}")
        except AssertionError:
            lines.append(f"FAIL  {test}")
        except BaseException as e:  # noqa: BLE001
            lines.append(f"ERROR {test}: {type(e).__name__}: {e}")
    return "\n".join([f"passed {passed}/{len(tests)}", *lines])


def run_python(code: str) -> str:
    """Executes `code`; returns what it printed, then the error if it raised."""
    import contextlib
    import io

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "snippet.py", "exec"), {"__name__": "__main__"})
    except BaseException as e:  # noqa: BLE001 - reported to the model
        return f"{out.getvalue()}error: {type(e).__name__}: {e}"
    return out.getvalue() or "(no output)"
