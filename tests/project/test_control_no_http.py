"""control/ does not speak HTTP: no module under servelm/control builds an exception with an HTTP status number
(a `SomethingError(404, ...)` or `status=409`); it raises a kind of refusal from control/errors.py and the
server maps it to a status."""

from __future__ import annotations

import ast
from pathlib import Path

import servelm
from servelm.control import errors

CONTROL = Path(servelm.__file__).parent / "control"
REFUSALS = {name for name, obj in vars(errors).items() if isinstance(obj, type) and issubclass(obj, Exception)}


def _callee(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _http_status(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and 100 <= node.value <= 599


def _exception_calls(tree: ast.AST):
    """Calls of an exception class: a refusal, anything named *Error/*Exception, or what a `raise` builds."""
    raised = {id(n.exc) for n in ast.walk(tree) if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _callee(node) or ""
            if id(node) in raised or name in REFUSALS or name.endswith(("Error", "Exception")):
                yield node


def test_no_control_module_raises_an_http_status():
    bad = []
    for path in sorted(CONTROL.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for call in _exception_calls(tree):
            args = list(call.args) + [k.value for k in call.keywords if k.arg in ("status", "status_code", "code")]
            if any(_http_status(a) for a in args):
                bad.append(f"{path.relative_to(CONTROL.parent.parent)}:{call.lineno}: {ast.unparse(call)[:80]}")
    assert not bad, "control/ raises with HTTP statuses (raise a class from control/errors.py instead):\n" + \
        "\n".join(bad)


def test_the_check_sees_an_http_status():
    tree = ast.parse("def f():\n    raise ControlError(409, 'busy')\n\nx = NotFound(status=404, message='m')\n")
    assert sum(any(_http_status(a) for a in list(c.args) + [k.value for k in c.keywords])
               for c in _exception_calls(tree)) == 2
