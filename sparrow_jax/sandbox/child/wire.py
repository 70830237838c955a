"""What crosses the sandbox's pipes: the result stream to the grader (one JSON object a line) and,
in script mode, plain data between the check and the candidate (ascii(value), rebuilt by a parser
of literals that makes only exact builtin types)."""

import ast
import json
import os

PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)
PLAIN_CONTAINERS = (list, tuple, set, frozenset)
PLAIN_DEPTH = 60  # nesting of plain data; the parser refuses ~200 levels of brackets


def emit(fd, obj):
  """Writes `obj` to the result stream `fd` as one line of JSON."""
  os.write(fd, (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8", "replace"))


def plain(value, depth=0):
  """Whether `value` is plain data: exact builtin scalars and containers of them. Subclasses are not
  (their __eq__, __hash__ or __repr__ would be the candidate's code)."""
  kind = type(value)
  if kind in PLAIN_SCALARS:
    return True
  if depth >= PLAIN_DEPTH:
    return False
  if kind is dict:
    return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
  return kind in PLAIN_CONTAINERS and all(plain(v, depth + 1) for v in value)


def _literal(node):
  """The value that the expression `node` of ascii(plain data) spells, built from exact builtin
  types (unlike ast.literal_eval, also nan and inf); ValueError for any other expression."""
  if isinstance(node, ast.Constant) and type(node.value) in PLAIN_SCALARS:
    return node.value
  if isinstance(node, ast.Name) and node.id in ("nan", "inf"):
    return float(node.id)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
    value = _literal(node.operand)
    if type(value) in (int, float):
      return -value
  elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](map(_literal, node.elts))
  elif isinstance(node, ast.Dict) and None not in node.keys:
    return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
  elif (
    isinstance(node, ast.Call)
    and isinstance(node.func, ast.Name)
    and not node.keywords
    and node.func.id in ("set", "frozenset")
    and all(isinstance(a, ast.Set) for a in node.args)
    and len(node.args) <= 1
  ):  # ascii(set()), ascii(frozenset({1}))
    return {"set": set, "frozenset": frozenset}[node.func.id](*map(_literal, node.args))
  raise ValueError(f"not plain data: {ast.dump(node)[:100]}")


def _write_all(fd, data):
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view) :]


def _read_exactly(fd, size):
  chunks = []
  while size:
    chunk = os.read(fd, min(size, 1 << 16))
    if not chunk:
      raise EOFError("the other process hung up")
    chunks.append(chunk)
    size -= len(chunk)
  return b"".join(chunks)


def send(fd, value):
  """One message: its 8-byte length, then ascii(value), which the receiver rebuilds with
  _literal."""
  if not plain(value):
    raise TypeError(
      f"only plain data crosses between the check and the candidate, not {value!r:.100}"
    )
  text = ascii(value).encode()
  _write_all(fd, len(text).to_bytes(8, "big") + text)


def receive(fd, limit):
  """The next message on `fd` (see send); ValueError for one over `limit` bytes or not plain."""
  size = int.from_bytes(_read_exactly(fd, 8), "big")
  if size > limit:
    raise ValueError(f"a message of {size} bytes, over the limit of {limit}")
  return _literal(ast.parse(_read_exactly(fd, size).decode("ascii"), mode="eval").body)
