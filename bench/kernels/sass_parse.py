"""Reading nvdisasm's SASS listing of a Triton kernel: instructions, the hot loop, classes, load widths.

Pure text processing (no GPU, no compiler), so bench/kernels/sass_stats.py's figures can be tested on a
captured listing. `nvdisasm -c kernel.cubin` prints one instruction a line,

    /*0c50*/              @!P0 LDG.E.U16 R60, desc[UR16][R26.64] ;

and a label line (`.L_x_1:`) where a branch lands. The hot loop (find_hot_loop): every backward
branch (a BRA whose target label comes before it) closes a loop spanning [target, branch]; of
the innermost loops that load from global memory (LDG, LDGSTS; no such loop inside them), the
one with the most global loads is the hot one, the shortest on a tie. A kernel without such a
loop (its loop unrolled away, or none; nvdisasm's closing `BRA` to itself loads nothing) has no
hot loop: the whole listing stands in for it, flagged.

Legend: B bytes.
"""

import collections
import dataclasses
import re

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
# Bytes a thread moves per global load or async copy, by the width suffix (no suffix: 4 B).
_WIDTHS = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}

# Instruction classes: the first class whose test matches an opcode (its name before the first dot,
# or the whole opcode for the conversions spelled with a suffix).
CLASSES = (
    ("global load", lambda op, full: op in ("LDG", "LDGSTS")),
    ("global store/atomic", lambda op, full: op in ("STG", "RED", "ATOM", "ATOMG")),
    ("shared LDS/STS", lambda op, full: op in ("LDS", "STS", "LDSM", "ATOMS")),
    ("barrier", lambda op, full: op in ("BAR", "DEPBAR", "ARRIVES", "SYNCS", "MEMBAR")),
    ("shuffle", lambda op, full: op == "SHFL"),
    ("convert", lambda op, full: op in ("I2F", "F2F", "F2I", "I2FP", "F2FP", "F2IP") or full == "HADD2.F32"),
    ("FFMA", lambda op, full: op == "FFMA"),
    ("FMUL", lambda op, full: op == "FMUL"),
    ("FADD", lambda op, full: op == "FADD"),
    ("other float", lambda op, full: op.startswith(("F", "H", "MUFU", "DADD", "DFMA", "DMUL"))),
    ("LOP3/shift", lambda op, full: op in ("LOP3", "SHF", "SGXT", "PRMT", "BMSK", "LOP", "SHL", "SHR")),
    ("uniform", lambda op, full: op.startswith("U") or op in ("S2UR", "R2UR")),
    ("integer", lambda op, full: op in ("IADD3", "IMAD", "LEA", "ISETP", "VIADD", "IMNMX", "SEL", "IABS", "MOV",
                                        "CS2R", "S2R", "P2R", "R2P", "PLOP3", "POPC", "FLO", "IADD", "VIMNMX",
                                        "LDC", "ULDC")),
    ("control", lambda op, full: op in ("BRA", "EXIT", "BSSY", "BSYNC", "WARPSYNC", "NOP", "CALL", "RET", "YIELD",
                                        "BMOV", "ACQBULK", "ELECT", "VOTE", "VOTEU")),
)


@dataclasses.dataclass(frozen=True, slots=True)
class Instruction:
    """One SASS instruction: its byte offset, guard predicate ('' if none), opcode and operands."""

    offset: int
    predicate: str
    opcode: str
    operands: str

    @property
    def base(self) -> str:
        """The opcode's name before its modifiers (LDG of LDG.E.128)."""
        return self.opcode.split(".")[0]

    def load_bytes(self) -> int:
        """Bytes a thread reads from global memory by this instruction (0 if it is no global load)."""
        if self.base not in ("LDG", "LDGSTS"):
            return 0
        for suffix in reversed(self.opcode.split(".")[1:]):
            if suffix in _WIDTHS:
                return _WIDTHS[suffix]
        return 4


@dataclasses.dataclass(frozen=True, slots=True)
class Listing:
    """A kernel's instructions in order and its labels' offsets."""

    instructions: tuple[Instruction, ...]
    labels: dict[str, int]


@dataclasses.dataclass(frozen=True, slots=True)
class Loop:
    """A range [start, end] of offsets closed by a backward branch; found False: no loop, the whole listing."""

    start: int
    end: int
    found: bool


def parse(text: str) -> Listing:
    """The instructions and labels of nvdisasm's listing (one kernel; other lines are ignored)."""
    instructions, labels, pending = [], {}, []
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTRUCTION.match(line)
        if m:
            offset = int(m.group(1), 16)
            for name in pending:
                labels[name] = offset
            pending = []
            instructions.append(Instruction(offset, (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    if not instructions:
        raise ValueError(f"no SASS instructions in the listing (starts {text[:80]!r})")
    end = instructions[-1].offset + 16
    for name in pending:  # labels after the last instruction (the function's end)
        labels[name] = end
    return Listing(tuple(instructions), labels)


def loops(listing: Listing) -> list[Loop]:
    """Every backward branch's loop."""
    out = []
    for ins in listing.instructions:
        target = _TARGET.search(ins.operands)
        if ins.base == "BRA" and target and listing.labels.get(target.group(1), ins.offset + 1) <= ins.offset:
            out.append(Loop(listing.labels[target.group(1)], ins.offset, True))
    return out


def body(listing: Listing, loop: Loop) -> list[Instruction]:
    """The instructions of loop's range (both ends included)."""
    return [i for i in listing.instructions if loop.start <= i.offset <= loop.end]


def _loads(listing: Listing, loop: Loop) -> int:
    return sum(1 for i in body(listing, loop) if i.load_bytes())


def find_hot_loop(listing: Listing) -> Loop:
    """Of the innermost loops with global loads, the one with the most, the shortest on a tie; the
    whole listing (found False) if none."""
    loading = [lp for lp in loops(listing) if _loads(listing, lp)]
    candidates = [lp for lp in loading if not any(
        other != lp and lp.start <= other.start and other.end <= lp.end for other in loading)]
    if not candidates:
        return Loop(listing.instructions[0].offset, listing.instructions[-1].offset, False)

    return min(candidates, key=lambda lp: (-_loads(listing, lp), lp.end - lp.start))


def classify(ins: Instruction) -> str:
    """The instruction's class (CLASSES' names, or 'other')."""
    for name, test in CLASSES:
        if test(ins.base, ins.opcode):
            return name
    return "other"


@dataclasses.dataclass(frozen=True, slots=True)
class LoopStats:
    """The hot loop's static counts: instructions (each issued once per warp and iteration), per class,
    global loads per opcode, and the bytes one thread loads from global memory per iteration."""

    found: bool
    instructions: int
    outside: int  # instructions in no loop that loads from global memory (run about once a program)
    classes: dict[str, int]
    loads: dict[str, int]
    load_bytes_per_thread: int
    async_copies: bool  # LDGSTS (cp.async into shared memory: a pipeline num_stages deep)
    prefetched: bool  # every widest load's registers first read in the next iteration (prefetched)


def loop_stats(text: str) -> LoopStats:
    """LoopStats of the hot loop of nvdisasm's listing."""
    listing = parse(text)
    loop = find_hot_loop(listing)
    ins = body(listing, loop)
    classes = collections.Counter(classify(i) for i in ins)
    loads = collections.Counter(i.opcode for i in ins if i.load_bytes())
    loading = [body(listing, lp) for lp in loops(listing) if _loads(listing, lp)]
    in_loops = {i.offset for b in loading for i in b} if loop.found else {i.offset for i in ins}
    outside = len(listing.instructions) - len(in_loops)
    return LoopStats(loop.found, len(ins), outside, dict(classes.most_common()), dict(loads.most_common()),
                     sum(i.load_bytes() for i in ins), any(i.base == "LDGSTS" for i in ins),
                     loop.found and prefetched(ins))


def _registers(ins: Instruction, destination: bool) -> set[str]:
    """The R registers ins writes (its first operand, widened by the load width) or reads (the rest)."""
    operands = ins.operands.split(",")
    if destination:
        first = re.match(r"\s*R(\d+)$", operands[0])
        width = max(1, ins.load_bytes() // 4)
        return {f"R{int(first.group(1)) + w}" for w in range(width)} if first else set()
    return set(re.findall(r"\bR\d+\b", ",".join(operands[1:])))


def prefetched(body_ins: list[Instruction]) -> bool:
    """Whether each of the loop's widest global loads (the weights') fills registers that nothing after
    it in the body reads: their values are used in the next iteration (software prefetch)."""
    loads = [i for i in body_ins if i.base == "LDG"]
    if not loads:
        return False
    widest = max(i.load_bytes() for i in loads)
    for n, ins in enumerate(body_ins):
        if ins.base == "LDG" and ins.load_bytes() == widest:
            written = _registers(ins, True)
            if any(written & _registers(later, False) for later in body_ins[n + 1:]):
                return False
    return True
