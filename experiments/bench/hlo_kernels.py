"""The kernels of an optimised XLA GPU module (its HLO text), with the bytes each must move.

Shared by experiments/studies/plan_on_cpu.py (programs compiled for the H200 without a GPU) and
experiments/bench/profile_fusions.py (a profiled step's kernels beside their bytes).
"""
import collections
import functools
import re

import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
               "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
INSTRUCTION = re.compile(r"(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")

# kind: "gemm", kLoop / kInput (XLA's elementwise and reduction fusions), a custom call's target,
# or copy / transpose / convert; bytes: per launch; launches: loop trips; instruction: the HLO
# instruction's name (a profile's hlo_op); computation: a fusion's fused computation.
Kernel = collections.namedtuple("Kernel", "kind bytes computation launches instruction")


def shape_bytes(text: str) -> int:
  return sum(DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
             for dtype, dims in SHAPE.findall(text))


@functools.lru_cache(maxsize=2)  # kernels, fused_ops and exact_fusion_bytes parse one module
def computations(hlo: str) -> tuple[dict, str]:
  """({computation name: its instruction lines}, the entry computation's name); not to be
  changed (cached)."""
  found, current, entry = {}, None, None
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and line.endswith("{"):
      current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      found[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current and line.startswith("  "):
      found[current].append(line.strip())
  return found, entry


def tuple_elements(typ: str) -> list[str]:
  """The element types of a tuple type "(bf16[2]{0}, (u8[0], f32[])))": top-level commas."""
  inner, depth, start, out = typ.strip()[1:-1], 0, 0, []
  for i, ch in enumerate(inner + ","):
    depth += (ch in "([{") - (ch in ")]}")
    if ch == "," and depth == 0:
      out.append(inner[start:i].strip())
      start = i + 1
  return out


def operand_type(types: dict, operand: str) -> str:
  """An operand's type: "x" is x's, "x#i" (an element of x's tuple result) its i-th element's,
  "x#i#j" the j-th of that."""
  name, *indices = operand.split("#")
  typ = types.get(name, "")
  for index in indices:
    typ = tuple_elements(typ)[int(index)] if typ.startswith("(") else ""
  return typ


def kernels(hlo: str) -> list[Kernel]:
  """Each kernel of an optimised HLO module, loop bodies once per trip (launches = trips), with
  the bytes of its operands and results as their shapes say (a fusion reading a slice of an
  operand, or one element of a loop's state tuple, counts all of it, and so does a scatter that
  updates its operand in place, e.g. the loss head's [C, V] buffer: an upper bound there)."""
  bodies, entry = computations(hlo)
  found = []

  def walk(name, trips):
    lines = [line for line in bodies[name] if INSTRUCTION.match(line)]
    parsed = [INSTRUCTION.match(line).groups() for line in lines]
    types = {var: typ for var, typ, _, _ in parsed}
    for (var, typ, op, rest), line in zip(parsed, lines):
      operands = [a.strip().lstrip("%") for a in rest.split(")")[0].split(",")
                  if a.strip().startswith("%")]
      size = shape_bytes(typ) + sum(shape_bytes(operand_type(types, a)) for a in operands)
      if op == "fusion":
        kind = re.search(r"kind=(k\w+)", line).group(1)
        kind = "gemm" if "gemm" in line or "cublas" in line else kind
        found.append(Kernel(kind, size, re.search(r"calls=%([\w.\-]+)", line).group(1), trips,
                            var))
      elif op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
        found.append(Kernel(target, size, target, trips, var))
      elif op in ("copy", "transpose", "convert"):
        found.append(Kernel(op, size, var, trips, var))
      elif op == "while":
        trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
        walk(re.search(r"body=%([\w.\-]+)", line).group(1), trips * int(trip.group(1) if trip
                                                                           else 1))

  walk(entry, 1)
  return found


# A fusion whose computation holds one of these reads or writes part of an operand: its count of
# bytes is an upper bound.
PARTIAL_OPS = ("scatter", "gather", "dynamic-slice", "dynamic-update-slice", "slice")


def exact_fusion_bytes(hlo: str, found: list[Kernel]) -> int:
  """The bytes of XLA's elementwise and reduction fusions whose count is exact: outside loops
  (a loop body's fusion may read one element of its state tuple) and with no op of PARTIAL_OPS.
  A lower bound on what those fusions move."""
  bodies, _ = computations(hlo)
  ops = lambda name: {m.group(3) for m in map(INSTRUCTION.match, bodies.get(name, [])) if m}
  return sum(k.bytes for k in found if k.kind in ("kLoop", "kInput") and k.launches == 1
             and not ops(k.computation) & set(PARTIAL_OPS))


def fused_ops(hlo: str, computation: str) -> str:
  """A fused computation's operations, most frequent first ("multiply x4, convert x2, ...")."""
  bodies, _ = computations(hlo)
  ops = collections.Counter(m.group(3) for m in map(INSTRUCTION.match, bodies.get(computation, []))
                            if m and m.group(3) not in ("parameter", "constant", "tuple",
                                                        "get-tuple-element", "bitcast"))
  return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in ops.most_common(6))
