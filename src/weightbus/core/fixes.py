"""The last line of an error message that names what the user should do (`fix: ...`).

A `PushError` gathers the fix lines of its engines' reasons at the end of its message, each
once; other errors end with theirs. docs/troubleshooting.md lists them.
"""

FIX_LINE = "\nfix: "


def with_fix(message: str, fix: str) -> str:
    """`message` ending with the line that names its fix."""
    return f"{message}{FIX_LINE}{fix}"


def split_fixes(message: str) -> tuple[str, list[str]]:
    """`message` without its fix lines, and those fixes."""
    first, *fixes = message.split(FIX_LINE)
    return first, fixes
