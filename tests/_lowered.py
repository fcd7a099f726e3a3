"""The loops of a lowered (StableHLO) program, told apart: ChaCha20's loops
over its ten double rounds, whose body is one double round (8 xor on the
state held as rows, 32 on sixteen separate words; no loop inside), and every
other loop (over records, steps, rejection passes)."""

import re

import jax

#: xor operations in one ChaCha20 double round on the state held as four
#: rows (d3p.random._keystream._blocks_as_rows: 2 quarter rounds of 4, each on a row)
DOUBLE_ROUND_XORS = 8
#: the same on the state held as sixteen separate words (8 quarter rounds of 4)
WORD_DOUBLE_ROUND_XORS = 32


def lowered_text(fn, *args, platform: str = "cuda") -> str:
    """StableHLO of ``jit(fn)(*args)`` lowered for ``platform`` (no device needed)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _region(text: str, open_at: int) -> str:
    """The text of the brace-delimited region whose ``{`` is at ``open_at``."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
    raise ValueError("unbalanced braces in the lowered program")


def _functions(text: str) -> dict:
    """name -> body of every ``func.func`` of a lowered module."""
    out = {}
    for match in re.finditer(r"func\.func (?:public |private )?@([\w.$-]+)\(", text):
        line_end = text.find("\n", match.end())   # the body opens with the signature line's last brace
        out[match.group(1)] = _region(text, text.rfind("{", match.end(), line_end))
    return out


def _counts(region: str, functions: dict) -> tuple:
    """``(xor, while)``: the xor and while operations ``region`` runs, with
    the functions it calls."""
    xor, loops = region.count("stablehlo.xor"), region.count("stablehlo.while")
    for name in re.findall(r"call @([\w.$-]+)", region):
        if name not in functions:   # a custom call's target
            continue
        x, w = _counts(functions[name], functions)
        xor, loops = xor + x, loops + w
    return xor, loops


def loop_bodies(text: str) -> list:
    """``(xor, while)`` of the body (``do`` region, with the functions it
    calls) of every ``stablehlo.while`` in ``text``."""
    functions = _functions(text)
    bodies = []
    for match in re.finditer(r"stablehlo\.while", text):
        do = text.find("} do {", match.end())
        bodies.append(_counts(_region(text, do + len("} do ")), functions))
    return bodies


def is_double_round_loop(body: tuple) -> bool:
    """Whether a loop's body is one ChaCha20 double round and nothing more."""
    xor, loops = body
    return loops == 0 and xor in (DOUBLE_ROUND_XORS, WORD_DOUBLE_ROUND_XORS)


def round_loops(text: str) -> int:
    """ChaCha20's loops over its double rounds in a lowered program."""
    return sum(is_double_round_loop(b) for b in loop_bodies(text))


def other_loops(text: str) -> int:
    """Every other loop of a lowered program."""
    return len(loop_bodies(text)) - round_loops(text)


def xor_outside_round_loops(text: str) -> int:
    """xor operations outside ChaCha20's round loops (with the functions called)."""
    functions = _functions(text)
    main = functions.get("main", text)
    total, _ = _counts(main, functions)
    return total - sum(xor for xor, loops in loop_bodies(text) if is_double_round_loop((xor, loops)))
