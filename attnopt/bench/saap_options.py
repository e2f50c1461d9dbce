"""``attnopt bench saap``'s command-line choices: the fused launches, the window's stream, and the integer lists
(selection warps, pipeline stages, window splits, split counts, keys a tile) that multiply a SAAP row; each refuses
a bad value before any GPU work, naming the valid ones."""
from __future__ import annotations

#: ``--saap-fuse`` choices -> (the plan's fused_select, fused_merge) and the method's suffix.
FUSE_CHOICES = {"both": ((True, True), ""), "none": ((False, False), "-unfused"),
                "select": ((True, False), "-fuse-select"), "merge": ((False, True), "-fuse-merge")}
#: The choice that is the planner's own plan for a centroid-scored index (SaapStrategy.candidates: fused_select for
#: centroid scoring, the merge apart): the bench's default times it first, so its verdict is what a user gets.
PLANNED_FUSE = "select"


def fuse_choices(text: str) -> list[str]:
    """The ``--saap-fuse`` list (keys of ``FUSE_CHOICES``, each once); ``ValueError`` naming them otherwise."""
    items = [x.strip() for x in (text or "both").split(",") if x.strip()]
    if not items or any(x not in FUSE_CHOICES for x in items):
        raise ValueError(f"--saap-fuse takes a comma-separated list of {', '.join(FUSE_CHOICES)}; got {text!r}")
    return list(dict.fromkeys(items))


#: ``--saap-window-stream`` choices -> (the plan's window_stream, window_after_scoring) and the method's suffix.
WINDOW_CHOICES = {"off": ((False, False), ""), "on": ((True, False), "-ws"), "late": ((True, True), "-wsl")}


def window_stream_choices(text: str) -> list[str]:
    """The ``--saap-window-stream`` list (keys of ``WINDOW_CHOICES``), each once; ``ValueError`` naming them
    otherwise."""
    items = [x.strip() for x in (text or "off").split(",") if x.strip()]
    if not items or any(x not in WINDOW_CHOICES for x in items):
        raise ValueError(f"--saap-window-stream takes a comma-separated list of {', '.join(WINDOW_CHOICES)}; "
                         f"got {text!r}")
    return list(dict.fromkeys(items))


def _int_choices(text: str, option: str, zero: str, allowed: tuple[int, ...]) -> list[int]:
    """A comma-separated list of ``option``'s integers (0: ``zero``, or one of ``allowed``), each once; ``ValueError``
    naming the choices otherwise."""
    try:
        items = [int(x) for x in (text or "0").split(",") if x.strip()]
    except ValueError:
        items = []
    if not items or any(x not in (0, *allowed) for x in items):
        raise ValueError(f"{option} takes a comma-separated list of 0 ({zero}), {', '.join(map(str, allowed))}; "
                         f"got {text!r}")
    return list(dict.fromkeys(items))


def select_warps_choices(text: str) -> list[int]:
    """The ``--saap-select-warps`` list (0: the kernel's rule, or 4, 8, 16, 32)."""
    return _int_choices(text, "--saap-select-warps", "the rule", (4, 8, 16, 32))


def stages_choices(text: str) -> list[int]:
    """The ``--saap-stages`` list (0: the plan's, or 2, 3)."""
    return _int_choices(text, "--saap-stages", "the plan's", (2, 3))


def window_splits_choices(text: str) -> list[int]:
    """The ``--saap-window-splits`` list (0: the plan's rule, or a count >= 1), each once; ``ValueError`` otherwise
    (a count must also be below the row's split count: the kernel refuses it, naming the range)."""
    try:
        items = [int(x) for x in (text or "0").split(",") if x.strip()]
    except ValueError:
        items = []
    if not items or any(x < 0 for x in items):
        raise ValueError(f"--saap-window-splits takes a comma-separated list of 0 (the rule) or counts >= 1; "
                         f"got {text!r}")
    return list(dict.fromkeys(items))


def saap_geometries(splits: str, block_n: str) -> tuple[list[int], list[int]]:
    """The ``--saap-splits`` and ``--saap-block-n`` lists (0 = the planner's choice; empty = [0]); ``ValueError``
    naming the valid values otherwise."""
    try:
        split_list = [int(x) for x in (splits or "0").split(",") if x.strip()]
        block_list = [int(x) for x in (block_n or "0").split(",") if x.strip()]
    except ValueError:
        split_list = block_list = [-1]
    if any(x < 0 for x in split_list) or any(x not in (0, 16, 32, 64, 128) for x in block_list):
        raise ValueError(f"--saap-splits takes comma-separated counts >= 0 (0: the planner's) and --saap-block-n "
                         f"0 (the planner's), 16, 32, 64 or 128; got {splits!r} and {block_n!r}")
    return split_list, block_list
