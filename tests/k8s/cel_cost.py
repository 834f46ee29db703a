"""The worst-case cost of a CRD's CEL rule, bounded the way the API server's estimator bounds it.

The API server (apiextensions-apiserver, cel-go's checker/cost.go) refuses a CRD whose rule's estimated
cost exceeds StaticEstimatedCostLimit (10^7), or whose rules together exceed 10^8. It sizes every value
from the schema: a list by `maxItems`, a map by `maxProperties`, a string by `maxLength`; without one,
by how many of the smallest element fit in the largest request (3 MiB): so an unbounded list a rule
iterates makes it cost millions of loop steps. The model here, over cel-python's parse tree:

* a field select, an identifier, a function's own call: 1; `!`, `&&`, `||`: both sides, plus 1;
* equality: 1 for scalars, strings 1 + ceil(0.1 x the shorter's length) (StringTraversalCostFactor);
  `x in [list]`: the list's length x that; `startsWith`: 1 + ceil(0.1 x the prefix's length);
* a list literal: 10 + its elements; `size()`, `has()`: 1 + the argument;
* `l.all(v, body)` (exists, ...): the range + its size x (body + 1): the size is maxItems / maxProperties.
A rule on a node inside lists runs once per element: its cost is multiplied by every enclosing maxItems.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from celpy.celparser import CELParser
from lark import Token

STATIC_ESTIMATED_COST_LIMIT = 10_000_000  # per rule (apiextensions-apiserver's validation)
STATIC_ESTIMATED_CRD_COST_LIMIT = 100_000_000  # every rule of the CRD together
MAX_REQUEST_BYTES = 3 * 1024 * 1024
_MACROS = {"all", "exists", "exists_one", "map", "filter"}
_PASS = {"expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication", "unary"}
_PASS |= {"member", "primary", "paren_expr"}


@dataclasses.dataclass
class Est:
    cost: int
    schema: dict[str, Any] | None = None  # the value's schema, when it comes from `self`
    size: int = 1  # strings: max length; lists/maps: max items; else 1
    elem: int = 0  # a list literal's longest string


def _bound(schema: dict[str, Any] | None) -> int:
    """The most elements (list/map) or characters (string) a value of `schema` can have."""
    if schema is None:
        return MAX_REQUEST_BYTES
    kind = schema.get("type")
    if kind == "array":
        return int(schema.get("maxItems", MAX_REQUEST_BYTES // 2))  # smallest element: `""` or `{}`
    if kind == "object":
        return int(schema.get("maxProperties", MAX_REQUEST_BYTES // 4))  # smallest entry: `"":""`
    if kind == "string":
        return int(schema.get("maxLength", MAX_REQUEST_BYTES))
    return 1


def _child(schema: dict[str, Any] | None, field: str) -> dict[str, Any] | None:
    if schema is None:
        return None
    props = schema.get("properties") or {}
    if field in props:
        return props[field]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _item(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a comprehension variable ranges over: list items, or map keys (strings, unbounded)."""
    if schema is not None and schema.get("type") == "array":
        return schema.get("items")
    return {"type": "string"}


def _eq(a: Est, b: Est) -> int:
    strings = [e for e in (a, b) if e.schema is None or e.schema.get("type") == "string"]
    return 1 + (math.ceil(0.1 * min(a.size, b.size)) if strings else 0)


class Estimator:
    def __init__(self, root: dict[str, Any]) -> None:
        self.scopes: list[dict[str, dict[str, Any] | None]] = [{"self": root}]

    def visit(self, node: Any) -> Est:
        if isinstance(node, Token):
            return self._token(node)
        kids = list(node.children)
        kind = node.data
        if kind in _PASS and len(kids) == 1:
            return self.visit(kids[0])
        if kind in ("conditionalor", "conditionaland"):
            a, b = self.visit(kids[0]), self.visit(kids[-1])
            return Est(a.cost + b.cost + 1)
        if kind == "unary":  # unary_not / unary_neg, operand
            return Est(self.visit(kids[-1]).cost + 1)
        if kind == "relation":  # relation_eq(lhs) rhs, relation_in(lhs) rhs, ...
            op, rhs = kids[0], self.visit(kids[1])
            lhs = self.visit(op.children[0])
            cost = lhs.cost + rhs.cost + _eq(lhs, rhs)
            if op.data == "relation_in":
                cost = lhs.cost + rhs.cost + rhs.size * _eq(lhs, Est(0, {"type": "string"}, rhs.elem))
            return Est(cost)
        if kind == "member_dot":
            target = self.visit(kids[0])
            schema = _child(target.schema, str(kids[1]))
            return Est(target.cost + 1, schema, _bound(schema))
        if kind == "member_dot_arg":
            return self._method(kids)
        if kind == "ident_arg":  # has(x), size(x)
            args = [self.visit(e) for e in kids[1].children] if len(kids) > 1 else []
            return Est(1 + sum(a.cost for a in args))
        if kind == "list_lit":
            items = [self.visit(e) for e in kids[0].children] if kids else []
            longest = max((i.size for i in items), default=0)
            return Est(10 + sum(i.cost for i in items), {"type": "array"}, len(items), longest)
        if kind in ("literal", "ident"):
            return self._token(kids[0])
        raise NotImplementedError(f"CEL cost: no model for {kind}")

    def _token(self, token: Token) -> Est:
        text = str(token)
        if token.type == "IDENT" or (text.isidentifier() and text not in ("true", "false", "null")):
            for scope in reversed(self.scopes):
                if text in scope:
                    return Est(1, scope[text], _bound(scope[text]))
            raise KeyError(f"CEL cost: unknown identifier {text}")
        if text[:1] in "'\"":
            return Est(0, {"type": "string"}, len(text) - 2)
        return Est(0, {"type": "number"})

    def _method(self, kids: list[Any]) -> Est:
        target, name = self.visit(kids[0]), str(kids[1])
        args = list(kids[2].children) if len(kids) > 2 else []
        if name in _MACROS:
            var = str(next(args[0].scan_values(lambda v: isinstance(v, Token))))
            self.scopes.append({var: _item(target.schema)})
            try:
                body = self.visit(args[1])
            finally:
                self.scopes.pop()
            return Est(target.cost + 1 + _bound(target.schema) * (body.cost + 1))
        arg = self.visit(args[0]) if args else Est(0)
        if name in ("startsWith", "endsWith"):
            return Est(target.cost + arg.cost + 1 + math.ceil(0.1 * arg.size))
        raise NotImplementedError(f"CEL cost: no model for .{name}()")


def rule_cost(rule: str, schema: dict[str, Any]) -> int:
    """The estimated cost of one evaluation of `rule` on a value of `schema`."""
    return Estimator(schema).visit(CELParser().parse(rule)).cost


def cardinality(root: dict[str, Any], path: tuple[str, ...]) -> int:
    """How many times a rule at `path` (crd_support.cel_rules' form: "[]" = list items) runs at most."""
    times, schema = 1, root
    for key in path:
        if key in ("[]", "{}"):
            times *= _bound(schema)
            schema = schema["items"] if key == "[]" else schema["additionalProperties"]
        else:
            schema = schema["properties"][key]
    return times


def node_schema(root: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    schema = root
    for key in path:
        schema = schema["items"] if key == "[]" else (
            schema["additionalProperties"] if key == "{}" else schema["properties"][key]
        )  # fmt: skip
    return schema
