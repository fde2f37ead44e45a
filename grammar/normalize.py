"""Turn a JSON schema of any draft in use into the exact subset a backend enforces, or refuse it by name.

`normalize_schema` walks the schema once (each subschema once: `$ref` targets are memoised into the
output's `$defs`, so a schema that would expand exponentially does not) and returns a schema that says
the same thing with only the keywords the backend compiles:

- annotations and unknown keywords are dropped, as the specification says validators must;
  a key that is almost a validation keyword ("maxitems") is refused (grammar/keywords.py);
- draft-04/06/07 forms become 2020-12 ones: `definitions`, `id`, boolean `exclusiveMinimum` and
  `exclusiveMaximum`, `items` as a list with `additionalItems`, `$ref` whose siblings are ignored;
- constraints with an exact positive equivalent are rewritten (grammar/rewrites.py): `dependencies`,
  `dependentRequired`, `dependentSchemas`, provably disjoint `oneOf`, `not`, `if`/`then`/`else`,
  `propertyNames`, `unevaluatedProperties` where it means `additionalProperties`;
- `format`: the backend's formats are kept, formats the specification defines but the backend does not
  enforce are refused, and other formats ("int32", "url") are annotations: dropped and reported;
- `uniqueItems`, the "regex" format, look-around in patterns and a `not` with no exact positive form
  cannot be expressed in a grammar: with `allow_approximate` the grammar admits a superset there
  (reported, by keyword) and the output guard (grammar/guard.py) enforces them exactly; without it
  they are refused. Overlapping oneOf branches are never approximated: they are refused.

Every refusal is a GrammarError naming the JSON pointer, the keyword and the reason (and, for a limit,
which limit and by how much).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from grammar.backend import GrammarBackend, GrammarLimits
from grammar.keywords import COUNTS, KNOWN, SPEC_FORMATS, TYPES, VALIDATION, dialect_of, near_miss, one_edit
from grammar.refs import RefIndex, child_pointer, schema_error
from grammar.spec import GrammarError

# Formats the specification defines that a grammar cannot express (the output guard checks them).
APPROXIMATED_FORMATS = frozenset({"regex"})
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
           ("minimum", "maximum"))


@dataclass
class NormalizeReport:
    """What normalization did besides copying: for metrics and for the compile result.

    ignored_formats: unknown `format` values dropped as annotations, by value.
    approximations: keywords the grammar over-approximates (the output guard enforces), by keyword.
    rewrites: rewrites applied, by kind ("dependencies", "oneOf->anyOf", "not", ...).
    def_pointers: for each `$defs` entry of the output, the pointer of the subschema it came from (so
        that a backend's refusal in the output can be pointed at in the input: grammar/locate.py).
    """

    ignored_formats: Counter[str] = field(default_factory=Counter)
    approximations: Counter[str] = field(default_factory=Counter)
    rewrites: Counter[str] = field(default_factory=Counter)
    def_pointers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NormalizedSchema:
    schema: dict
    report: NormalizeReport


def normalize_schema(schema: Any, backend: GrammarBackend, limits: GrammarLimits,
                     allow_approximate: bool = True) -> NormalizedSchema:
    """Raise GrammarError unless `backend` can enforce `schema` exactly (up to the reported
    approximations); return the schema it should compile. Mutates nothing."""
    normalizer = Normalizer(schema, backend, limits, allow_approximate)
    return NormalizedSchema(normalizer.run(), normalizer.report)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class Normalizer:
    def __init__(self, root: Any, backend: GrammarBackend, limits: GrammarLimits, allow_approximate: bool) -> None:
        if not isinstance(root, dict):
            raise GrammarError(f"json_schema must be a JSON object, got {type(root).__name__}")
        self.root = root
        self.backend = backend
        self.limits = limits
        self.allow_approximate = allow_approximate
        self.dialect = dialect_of(root)
        self.refs = RefIndex(root, self.dialect)
        if self.refs.num_nodes > limits.max_schema_nodes:
            raise GrammarError(
                f"json_schema is too large: {self.refs.num_nodes} subschemas, {self.refs.num_nodes - limits.max_schema_nodes}"
                f" over the limit of {limits.max_schema_nodes} (GrammarLimits.max_schema_nodes)")
        self.report = NormalizeReport()
        self.defs: dict[str, Any] = {}
        self._names: dict[int, str] = {}  # id(target node) -> its name in defs
        self._open: list[int] = []  # $ref targets being normalized (a chain of nested references)

    def run(self) -> dict:
        top = self.node(self.root, "#", self.refs.root_base)
        if top is False:
            raise schema_error("#", "the schema admits no instance at all")
        out: dict = {} if top is True else dict(top)
        if self.defs:
            out["$defs"] = self.defs
        return out

    # ----- subschemas --------------------------------------------------------------------------------

    def node(self, raw: Any, pointer: str, base: str) -> dict | bool:
        """The normalized form of the subschema `raw` found at `pointer`."""
        if isinstance(raw, bool):
            return raw
        if not isinstance(raw, dict):
            raise schema_error(pointer, f"a schema must be an object or a boolean, got {type(raw).__name__}")
        base = self.refs.base_of(raw, base)
        if "$ref" in raw:
            target = self.ref(raw["$ref"], child_pointer(pointer, "$ref"), base)
            if self.dialect in ("draft4", "draft6", "draft7"):
                return target  # NOTE: before 2019-09 the siblings of $ref are ignored (the validators agree)
            rest = self.keywords({k: v for k, v in raw.items() if k != "$ref"}, pointer, base)
            return _conjoin([target, rest])
        return self.keywords(raw, pointer, base)

    def ref(self, ref: Any, where: str, base: str) -> dict | bool:
        target, pointer, inner = self.refs.resolve(ref, base, where)
        if isinstance(target, bool):
            return target
        key = id(target)
        if key in self._open:
            if not self.backend.supports_recursive_ref:
                raise schema_error(where, f"recursive $ref {ref!r} is not supported by the {self.backend.name} backend")
        elif key not in self._names:
            if len(self._open) >= self.limits.max_ref_depth:
                raise schema_error(where, f"$ref chain of {len(self._open) + 1} nested references, over the limit of "
                                          f"{self.limits.max_ref_depth} (GrammarLimits.max_ref_depth)")
            name = f"d{len(self._names)}"
            self._names[key] = name
            self.report.def_pointers[name] = pointer
            self._open.append(key)
            try:
                self.defs[name] = self.node(target, pointer, inner)
            finally:
                self._open.pop()
        return {"$ref": f"#/$defs/{self._names[key]}"}

    def resolve(self, raw: Any, pointer: str, base: str) -> tuple[Any, str, str]:
        """Follow `raw`'s $ref chain (for rewrites that look inside a subschema)."""
        seen = 0
        while isinstance(raw, dict) and "$ref" in raw and (self.dialect in ("draft4", "draft6", "draft7")
                                                          or set(raw) <= {"$ref"} | (KNOWN - VALIDATION)):
            seen += 1
            if seen > self.limits.max_ref_depth:
                raise schema_error(pointer, f"$ref chain longer than the limit of {self.limits.max_ref_depth}")
            raw, pointer, base = self.refs.resolve(raw["$ref"], self.refs.base_of(raw, base),
                                                   child_pointer(pointer, "$ref"))
        return raw, pointer, base

    # ----- keywords ----------------------------------------------------------------------------------

    def keywords(self, raw: dict, pointer: str, base: str) -> dict | bool:
        from grammar import rewrites

        out: dict[str, Any] = {}
        conj: list[Any] = []  # more constraints on the same instance, from rewrites
        origin: dict[str, str] = {}  # output keyword -> the input keyword it came from
        for key, value in raw.items():
            where = child_pointer(pointer, key)
            if key not in VALIDATION:
                intended = near_miss(key) if key not in KNOWN else None
                if intended is not None:
                    raise schema_error(where, f"unknown keyword {key!r} looks like a misspelt {intended!r}: refused "
                                              "rather than ignored (it would constrain nothing)")
                continue
            if key in ("properties", "patternProperties"):
                if not isinstance(value, dict):
                    raise schema_error(where, f"{key!r} must be an object of schemas")
                names = {name: name for name in value}
                if key == "patternProperties":
                    names = {name: self.pattern_property(raw, name, child_pointer(where, name)) for name in value}
                out[key] = {names[name]: self.node(sub, child_pointer(where, name), base) for name, sub in value.items()}
            elif key in ("$defs", "definitions", "then", "else", "minContains", "maxContains", "$ref"):
                continue  # reached through $ref / handled with if / with contains / in node()
            elif key in ("additionalProperties", "propertyNames", "unevaluatedItems") and isinstance(value, list):
                raise schema_error(where, f"{key!r} must be a schema")
            elif key == "additionalProperties":
                out[key] = self.node(value, where, base)
            elif key == "items":
                self.items(raw, value, where, base, out)
            elif key == "additionalItems":
                continue  # read by items()
            elif key == "prefixItems":
                out[key] = [self.node(sub, child_pointer(where, i), base) for i, sub in enumerate(self.list_of(key, value, where))]
            elif key in ("anyOf", "allOf"):
                subs = [self.node(sub, child_pointer(where, i), base) for i, sub in enumerate(self.list_of(key, value, where))]
                conj.extend(subs) if key == "allOf" else conj.append({"anyOf": subs})
            elif key == "oneOf":
                conj.append(rewrites.one_of(self, value, where, base))
                origin["anyOf"] = "oneOf"
            elif key == "not":
                try:
                    conj.append(rewrites.negate(self, value, where, base))
                    self.report.rewrites["not"] += 1
                except GrammarError:
                    if not self.allow_approximate:
                        raise
                    # NOTE: dropping a conjunct admits a superset; every composition here (and, or) keeps
                    # supersets supersets, and negations are computed from the raw schema, never from this.
                    self.report.approximations["not"] += 1
            elif key == "if":
                conj.append(rewrites.if_then_else(self, raw, pointer, base))
            elif key in ("dependencies", "dependentRequired", "dependentSchemas"):
                conj.extend(rewrites.dependencies(self, key, value, where, base))
            elif key in ("propertyNames", "unevaluatedProperties"):
                continue  # below: they read the finished properties / additionalProperties
            elif key in ("contains", "unevaluatedItems", "$dynamicRef", "$recursiveRef"):
                if key == "unevaluatedItems" and value is True:
                    continue
                raise schema_error(where, f"keyword {key!r} is not supported: the {self.backend.name} backend would "
                                          "not enforce it")
            elif key == "uniqueItems":
                self.unique_items(raw, value, where)
            elif key == "format":
                self.format(value, where, out, conj)
            else:
                self.scalar(key, value, where, raw, out)
        if "propertyNames" in raw:
            rewrites.property_names(self, raw, raw["propertyNames"], child_pointer(pointer, "propertyNames"), base,
                                    out, conj)
        if "unevaluatedProperties" in raw:
            rewrites.unevaluated_properties(self, raw, raw["unevaluatedProperties"], pointer, base, out)
        if conj:
            joined = _conjoin([out, *conj])
            if joined is False or joined is True:
                return joined
            out = joined
        self.check_backend(out, pointer, origin)
        self.check_bounds(out, pointer)
        return out

    def list_of(self, key: str, value: Any, where: str) -> list:
        if not isinstance(value, list) or not value:
            raise schema_error(where, f"{key!r} must be a non-empty list of schemas")
        return value

    def items(self, raw: dict, value: Any, where: str, base: str, out: dict) -> None:
        if isinstance(value, list):
            if self.dialect == "draft2020":
                raise schema_error(where, "in draft 2020-12 'items' must be a schema: use prefixItems for tuples (or "
                                          "declare the draft-07 $schema)")
            out["prefixItems"] = [self.node(sub, child_pointer(where, i), base) for i, sub in enumerate(value)]
            if "additionalItems" in raw:
                out["items"] = self.node(raw["additionalItems"], child_pointer(where[: where.rfind("/")],
                                                                             "additionalItems"), base)
            self.report.rewrites["items[] -> prefixItems"] += 1
        else:
            out["items"] = self.node(value, where, base)

    def unique_items(self, raw: dict, value: Any, where: str) -> None:
        if not isinstance(value, bool):
            raise schema_error(where, "'uniqueItems' must be a boolean")
        if not value or raw.get("maxItems") in (0, 1):
            return  # nothing to enforce
        if not self.allow_approximate:
            raise schema_error(where, f"keyword 'uniqueItems' is not supported: the {self.backend.name} backend would "
                                      "not enforce it")
        self.report.approximations["uniqueItems"] += 1

    def format(self, value: Any, where: str, out: dict, conj: list) -> None:
        from grammar.formats import FORMAT_PATTERNS

        if not isinstance(value, str):
            raise schema_error(where, f"'format' must be a string, got {value!r}")
        if value in self.backend.supported_formats:
            out["format"] = value
            if value in self.backend.approximate_formats:
                if not self.allow_approximate:
                    raise schema_error(where, f"format {value!r} is only approximated by the {self.backend.name} backend")
                self.report.approximations[f"format {value}"] += 1
        elif value in FORMAT_PATTERNS:
            conj.append({"pattern": FORMAT_PATTERNS[value]})
            self.report.rewrites[f"format {value} -> pattern"] += 1
        elif value in APPROXIMATED_FORMATS and self.allow_approximate:
            self.report.approximations[f"format {value}"] += 1
        elif value in SPEC_FORMATS:
            raise schema_error(where, f"format {value!r} is not enforced by the {self.backend.name} backend "
                                      f"(enforced: {', '.join(sorted(self.backend.supported_formats | set(FORMAT_PATTERNS)))})")
        else:
            intended = next((f for f in sorted(SPEC_FORMATS) if len(value) >= 5 and one_edit(value, f)), None)
            if intended is not None:
                raise schema_error(where, f"format {value!r} looks like a misspelt {intended!r}: refused rather than "
                                          "ignored as an unknown format")
            self.report.ignored_formats[value] += 1  # not a format the specification defines: an annotation

    def scalar(self, key: str, value: Any, where: str, raw: dict, out: dict) -> None:
        if key in COUNTS:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                if not (isinstance(value, float) and value.is_integer() and value >= 0):
                    raise schema_error(where, f"{key!r} must be a non-negative integer, got {value!r}")
                value = int(value)
            out[key] = value
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            if self.dialect != "draft4":
                raise schema_error(where, f"a boolean {key!r} is the draft-04 form: declare the draft-04 $schema or "
                                          f"give the bound as a number")
            if value and bound in raw:
                out[key] = raw[bound]
                self.report.rewrites["draft-04 exclusive bound"] += 1
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
            if not is_number(value) or (key == "multipleOf" and value <= 0):
                raise schema_error(where, f"{key!r} must be a {'positive ' if key == 'multipleOf' else ''}number, "
                                          f"got {value!r}")
            exclusive = "exclusiveMinimum" if key == "minimum" else "exclusiveMaximum"
            if key in ("minimum", "maximum") and raw.get(exclusive) is True and self.dialect == "draft4":
                return  # becomes the exclusive bound
            out[key] = value
        elif key == "type":
            names = value if isinstance(value, list) else [value]
            if not names or len(set(map(str, names))) != len(names) or not all(n in TYPES for n in names):
                raise schema_error(where, f"'type' must be one of {sorted(TYPES)} or a list of them, got {value!r}")
            out[key] = value
        elif key == "required":
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                raise schema_error(where, "'required' must be a list of property names")
            if value:
                out[key] = list(dict.fromkeys(value))
        elif key == "enum":
            if not isinstance(value, list) or not value:
                raise schema_error(where, "'enum' must be a non-empty list")
            out[key] = value
        elif key == "const":
            out[key] = value
        elif key == "pattern":
            out[key] = self.check_regex(value, where, approximate=True)
        else:  # pragma: no cover - every VALIDATION keyword has a branch above
            raise schema_error(where, f"keyword {key!r} is not handled")

    # ----- checks ------------------------------------------------------------------------------------

    def check_regex(self, pattern: Any, where: str, approximate: bool = False) -> str:
        """The pattern the backend should compile for `pattern`: itself, or (with `approximate`, for the
        `pattern` keyword) without its look-around assertions, which the backend's Rust regex engine lacks:
        a superset the output guard narrows back. Raises GrammarError for a pattern neither the backend nor
        the guard can use."""
        from grammar.formats import has_lookaround, python_to_rust, rust_regex_error, strip_lookaround
        from grammar.guard import compile_pattern

        if not isinstance(pattern, str):
            raise schema_error(where, f"a pattern must be a string, got {pattern!r}")
        try:
            compile_pattern(pattern)
        except Exception as e:  # noqa: BLE001 - re.error or regex.error: the guard could not check it
            raise schema_error(where, f"invalid pattern {pattern!r}: {e}") from None
        try:
            re.compile(pattern)
            python_ok = True
        except re.error:
            python_ok = False
        translated = python_to_rust(pattern)
        if python_ok and not has_lookaround(translated):
            return translated  # NOTE: Python and Rust syntax agree here; llguidance reports the rare exception
        error = rust_regex_error(translated)
        if not error:
            return translated
        stripped = strip_lookaround(translated) if has_lookaround(translated) else None
        if approximate and self.allow_approximate and stripped is not None and not rust_regex_error(stripped):
            self.report.approximations["pattern look-around"] += 1
            return stripped
        raise schema_error(where, f"pattern {pattern!r} is not supported by the {self.backend.name} backend: {error}")

    def pattern_property(self, raw: dict, pattern: str, where: str) -> str:
        """The patternProperties key the backend compiles for `pattern`. Without look-around a pattern
        matches more names; that only loosens the schema (a superset the output guard narrows) when
        additionalProperties is false and no declared property changes sides."""
        closed = raw.get("additionalProperties") is False
        grammar_pattern = self.check_regex(pattern, where, approximate=closed)
        if grammar_pattern != pattern:
            original, loose = re.compile(pattern), re.compile(grammar_pattern)
            if any(bool(original.search(p)) != bool(loose.search(p)) for p in raw.get("properties") or {}):
                raise schema_error(where, f"pattern {pattern!r} has look-around, which the {self.backend.name} backend "
                                          "does not support, and a declared property depends on it: refused")
        return grammar_pattern

    def check_backend(self, out: dict, pointer: str, origin: dict[str, str]) -> None:
        for key in out:
            if key in self.backend.unsupported_keywords:
                source = origin.get(key, key)
                how = "" if source == key else f" (its rewrite needs {key!r})"
                raise schema_error(child_pointer(pointer, source), f"keyword {source!r} is not supported: the "
                                   f"{self.backend.name} backend would not enforce it{how}")
        if "format" in out and "format" in self.backend.unsupported_keywords:  # pragma: no cover
            raise schema_error(pointer, "format not supported")

    def check_bounds(self, node: dict, pointer: str) -> None:
        for low, high in _BOUNDS:
            if low in node and high in node and node[low] > node[high]:
                raise schema_error(pointer, f"unsatisfiable: {low} {node[low]} > {high} {node[high]}")
        if node.get("additionalProperties") is False and isinstance(node.get("required"), list) \
                and not node.get("patternProperties") and not any(k in node for k in ("allOf", "anyOf", "$ref")):
            allowed = node.get("properties") or {}
            for name in node["required"]:
                if name not in allowed:
                    raise schema_error(pointer, f"unsatisfiable: required property {name!r} is not in 'properties' "
                                                "and additionalProperties is false")


_INTERACTING = (frozenset({"properties", "patternProperties", "additionalProperties"}),
                frozenset({"prefixItems", "items"}))


def _conjoin(parts: list[Any]) -> dict | bool:
    """One schema that holds when all of `parts` hold: merged into one object where that means the same
    (no shared key, and no additionalProperties / items that would start to cover the other part's
    properties / prefixItems), the rest under allOf."""
    if any(p is False for p in parts):
        return False
    parts = [p for p in parts if p is not True and p != {}]
    if not parts:
        return {}
    if len(parts) == 1:
        return parts[0]
    merged: dict[str, Any] = dict(parts[0])
    rest = []
    for part in parts[1:]:
        clash = set(part) & set(merged) or any(set(part) & group and set(merged) & group for group in _INTERACTING)
        if clash:
            rest.append(part)
        else:
            merged.update(part)
    if rest:
        merged["allOf"] = [*merged.get("allOf", []), *rest]
    return merged
