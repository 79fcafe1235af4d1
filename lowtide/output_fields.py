"""Output fields: their JSON types and how a long row's chunk answers combine into one answer.

Shared by the job file (which checks the rules) and the store (which applies them in SQL).
"""

from __future__ import annotations

from typing import Any, Literal

ReduceRule = Literal["first", "majority", "any", "all", "max", "min", "mean", "concat", "union"]
"""How the answers of a long row's chunks combine into the row's answer, per output field."""


def json_type(spec: dict[str, Any]) -> str:
    """A property's JSON type, a nullable union like ["string", "null"] read as its other type."""
    kind = spec.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind)


def default_reduce(spec: dict[str, Any]) -> str:
    """Labels vote, flags raise an alarm if any chunk does, counts keep the largest, measures
    average, free text is joined in order, lists are merged."""
    kind = json_type(spec)
    if "enum" in spec:
        return "majority"
    return {
        "boolean": "any",
        "integer": "max",
        "number": "mean",
        "string": "concat",
        "array": "union",
    }.get(kind, "first")


RULE_NEEDS: dict[str, tuple[str, ...]] = {
    # rule -> the field types it applies to ("enum": a string field with an enum, in its order)
    "any": ("boolean",),
    "all": ("boolean",),
    "mean": ("integer", "number"),
    "max": ("integer", "number", "enum"),
    "min": ("integer", "number", "enum"),
    "concat": ("string",),
    "union": ("array",),
}
