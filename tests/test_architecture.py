"""ARCHITECTURE.md's import levels hold: every kdjax module is in the table, each unit (a top-level
module, or a package as a whole) imports only from lower levels (at module level or inside
functions), and the modules of a package import each other without cycles."""
import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kdjax"


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
  """The table's name for a module's unit: "loss/" for kdjax.loss.*, "plots" for kdjax.plots."""
  name = module.split(".")[1]
  return f"{name}/" if (PACKAGE / name).is_dir() else name


@functools.cache
def imports() -> dict:
  """module -> the kdjax modules it imports (a name imported from a package: its module if it is
  one, else the package); a package's own modules importing it are left out."""
  paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
  out = {}
  for module, path in paths.items():
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                 for a in node.names]
      else:
        continue
      for name in names:
        while name and name not in paths:
          name = name.rpartition(".")[0]
        if name.startswith("kdjax.") and not f"{module}.".startswith(f"{name}."):
          found.add(name)
    out[module] = found
  return out


def levels() -> dict:
  text = (ROOT / "ARCHITECTURE.md").read_text()
  block = text.split("## Import levels", 1)[1].split("```", 2)[1]
  return {name: int(level) for level, names in re.findall(r"^(\d+) +(.+)$", block, re.M)
          for name in names.split()}


def test_the_import_levels_hold():
  graph, level = imports(), levels()
  assert sorted({unit(m) for m in graph if m != "kdjax"}) == sorted(level)
  upward = [(m, d) for m, deps in graph.items() if m != "kdjax" for d in deps
            if unit(m) != unit(d) and level[unit(d)] >= level[unit(m)]]
  assert not upward, f"imports at or above their own level (ARCHITECTURE.md): {upward}"


def test_no_import_cycles():
  graph, done, path = imports(), set(), []

  def visit(module):
    assert module not in path, f"import cycle: {' -> '.join(path[path.index(module):] + [module])}"
    if module in done:
      return
    path.append(module)
    for dep in graph[module]:
      visit(dep)
    path.pop()
    done.add(module)

  for module in graph:
    visit(module)
