"""Exact rewrites of keywords no backend implements into ones it does (used by grammar/normalize.py).

Each function returns normalized schemas (or adds to the node being built) that admit exactly the
instances the input keyword admits, or raises GrammarError naming pointer, keyword and reason:

- dependencies / dependentRequired / dependentSchemas: "if p is present then ..." becomes
  anyOf [p absent ({"properties": {p: false}}), p present and the dependency holds];
- oneOf whose branches are provably pairwise disjoint (distinct types, distinct const/enum values of a
  property both require, a property one requires and the other forbids, disjoint enum/const) is anyOf;
  overlapping branches are refused;
- not: De Morgan over the keywords of its subschema, each negated exactly where a positive form exists
  (type, const, enum of scalars, required, length/count/range bounds, properties, anyOf/allOf/not);
- if/then/else: anyOf [if and then, not(if) and else];
- propertyNames (a pattern, enum or const) becomes patternProperties / forbidden properties;
- unevaluatedProperties where no applicator can evaluate a property: it is additionalProperties.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from grammar.keywords import KNOWN, TYPES, VALIDATION
from grammar.refs import child_pointer, schema_error
from grammar.spec import escape_regex_literal

if TYPE_CHECKING:
    from grammar.normalize import Normalizer

_ANY = "(?s:.)"
# the instance kinds a type admits; number = integer + non-integer numbers
_KINDS = {"object": {"object"}, "array": {"array"}, "string": {"string"}, "boolean": {"boolean"},
          "null": {"null"}, "integer": {"integer"}, "number": {"integer", "fraction"}}
_ALL_KINDS = frozenset().union(*_KINDS.values())
_APPLIES_TO = {"minLength": "string", "maxLength": "string", "pattern": "string", "format": "string",
               "minItems": "array", "maxItems": "array", "minProperties": "object", "maxProperties": "object",
               "required": "object", "properties": "object", "minimum": "number", "maximum": "number",
               "exclusiveMinimum": "number", "exclusiveMaximum": "number"}
# keywords that only constrain instances of one type (anything else satisfies them)
_KEYWORD_TYPES = {
    **_APPLIES_TO, "multipleOf": "number", "patternProperties": "object", "additionalProperties": "object",
    "propertyNames": "object", "dependencies": "object", "dependentRequired": "object",
    "dependentSchemas": "object", "unevaluatedProperties": "object", "items": "array", "prefixItems": "array",
    "additionalItems": "array", "contains": "array", "uniqueItems": "array", "unevaluatedItems": "array",
}
_FLIP = {"minLength": ("maxLength", -1), "maxLength": ("minLength", 1), "minItems": ("maxItems", -1),
         "maxItems": ("minItems", 1), "minProperties": ("maxProperties", -1), "maxProperties": ("minProperties", 1),
         "minimum": ("exclusiveMaximum", 0), "maximum": ("exclusiveMinimum", 0),
         "exclusiveMinimum": ("maximum", 0), "exclusiveMaximum": ("minimum", 0)}


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "fraction"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names[type(value)]


def _types_for(kinds: set[str]) -> list[str]:
    """The type list admitting exactly `kinds`; None if no list does (integer without fractions is fine,
    fractions without integers are not expressible)."""
    names: list[str] = [t for t in ("object", "array", "string", "boolean", "null") if t in kinds]
    if {"integer", "fraction"} <= kinds:
        names.append("number")
    elif "integer" in kinds:
        names.append("integer")
    elif "fraction" in kinds:
        raise ValueError("non-integer numbers alone")
    return names


def _only(kinds: set[str]) -> dict | bool:
    if not kinds:
        return False
    return {"type": _types_for(kinds)} if kinds != _ALL_KINDS else True


# ----- dependencies ---------------------------------------------------------------------------------


def dependencies(n: Normalizer, key: str, value: Any, where: str, base: str) -> list[Any]:
    if not isinstance(value, dict):
        raise schema_error(where, f"{key!r} must be an object")
    out: list[Any] = []
    for name, dep in value.items():
        at = child_pointer(where, name)
        absent = {"properties": {name: False}}
        if isinstance(dep, list) and key != "dependentSchemas":
            if not all(isinstance(d, str) for d in dep):
                raise schema_error(at, "a property dependency must list property names")
            if dep:
                out.append({"anyOf": [absent, {"required": list(dict.fromkeys([name, *dep]))}]})
        elif isinstance(dep, dict | bool) and key != "dependentRequired":
            schema = n.node(dep, at, base)
            if schema is not True:
                present = {"required": [name]} if schema is False else {"required": [name], "allOf": [schema]}
                out.append(absent if schema is False else {"anyOf": [absent, present]})
        else:
            raise schema_error(at, f"a {key!r} entry must be a {'list of names' if key == 'dependentRequired' else 'schema'}"
                                   f"{' or a list of names' if key == 'dependencies' else ''}")
        n.report.rewrites[key] += 1
    if len(out) > n.limits.max_dependencies:
        raise schema_error(where, f"{len(out)} dependencies, {len(out) - n.limits.max_dependencies} over the limit of "
                                  f"{n.limits.max_dependencies} (GrammarLimits.max_dependencies): each doubles the grammar")
    return out


# ----- oneOf ----------------------------------------------------------------------------------------


class _Facts:
    """What every instance of one branch has: its possible kinds, and for objects the required
    properties, the values some of them are limited to, and the forbidden ones."""

    def __init__(self) -> None:
        self.kinds: set[str] = set(_ALL_KINDS)
        self.values: set[str] | None = None  # canonical JSON of the only values allowed
        self.required: set[str] = set()
        self.property_values: dict[str, set[str]] = {}
        self.forbidden: set[str] = set()
        self.closed: list[set[str]] = []  # each: the only property names allowed (additionalProperties false)


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _facts(n: Normalizer, raw: Any, pointer: str, base: str, facts: _Facts, depth: int = 0) -> _Facts:
    raw, pointer, base = n.resolve(raw, pointer, base)
    if raw is False:
        facts.kinds = set()
    if not isinstance(raw, dict) or depth > 8:
        return facts
    if isinstance(raw.get("type"), str | list):
        names = raw["type"] if isinstance(raw["type"], list) else [raw["type"]]
        facts.kinds &= set().union(*(_KINDS.get(t, set()) for t in names))
    for key in ("const", "enum"):
        if key in raw and (key == "const" or isinstance(raw[key], list)):
            values = [raw["const"]] if key == "const" else raw["enum"]
            canon = {_canon(v) for v in values}
            facts.values = canon if facts.values is None else facts.values & canon
            facts.kinds &= {_kind_of(v) for v in values}
    if isinstance(raw.get("required"), list):
        facts.required |= {r for r in raw["required"] if isinstance(r, str)}
    props: dict[str, Any] = raw["properties"] if isinstance(raw.get("properties"), dict) else {}
    for name, sub in props.items():
        sub, _, _ = n.resolve(sub, child_pointer(pointer, name), base)
        if sub is False:
            facts.forbidden.add(name)
        elif isinstance(sub, dict) and ("const" in sub or isinstance(sub.get("enum"), list)):
            values = {_canon(sub["const"])} if "const" in sub else {_canon(v) for v in sub["enum"]}
            facts.property_values[name] = facts.property_values.get(name, values) & values
    if raw.get("additionalProperties") is False and not raw.get("patternProperties"):
        facts.closed.append(set(props))
    for i, sub in enumerate(raw.get("allOf") or []):
        _facts(n, sub, child_pointer(pointer, f"allOf/{i}"), base, facts, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(raw.get(key), list) and raw[key]:
            alternatives = [_facts(n, sub, child_pointer(pointer, f"{key}/{i}"), base, _Facts(), depth + 1)
                            for i, sub in enumerate(raw[key])]
            facts.kinds &= set().union(*(a.kinds for a in alternatives))
            if all(a.values is not None for a in alternatives):
                values = set().union(*(a.values or set() for a in alternatives))
                facts.values = values if facts.values is None else facts.values & values
    if "$ref" in raw and depth < 8:  # 2019-09+ $ref with siblings: its target holds too
        target, at, inner = n.refs.resolve(raw["$ref"], n.refs.base_of(raw, base), child_pointer(pointer, "$ref"))
        _facts(n, target, at, inner, facts, depth + 1)
    return facts


def _excludes(facts: _Facts, branch: Any) -> bool:
    """A shallow proof that no instance described by `facts` satisfies the normalized `branch`."""
    if branch is False:
        return True
    if not isinstance(branch, dict):
        return False
    if "type" in branch:
        names = branch["type"] if isinstance(branch["type"], list) else [branch["type"]]
        if not facts.kinds & set().union(*(_KINDS[t] for t in names)):
            return True
    if facts.kinds <= {"object"}:
        props = branch.get("properties") or {}
        if any(props.get(r) is False for r in facts.required):
            return True
    return False


def _and_not(facts: _Facts, part: Any, negation: Any) -> list[Any]:
    """part and negation, with negation's anyOf branches that cannot hold next to part dropped."""
    if isinstance(negation, dict) and set(negation) == {"anyOf"}:
        kept = [b for b in negation["anyOf"] if not _excludes(facts, b)]
        return [part, _any(kept)]
    return [part, False if _excludes(facts, negation) else negation]


def _forbids(facts: _Facts, name: str) -> bool:
    return name in facts.forbidden or any(name not in allowed for allowed in facts.closed)


def _disjoint(a: _Facts, b: _Facts) -> bool:
    common = a.kinds & b.kinds
    if not common:
        return True
    if a.values is not None and b.values is not None and not a.values & b.values:
        return True
    if common != {"object"}:
        return False
    for name in a.required & b.required:
        if name in a.property_values and name in b.property_values \
                and not a.property_values[name] & b.property_values[name]:
            return True
    return any(_forbids(b, r) for r in a.required) or any(_forbids(a, r) for r in b.required)


def one_of(n: Normalizer, value: Any, where: str, base: str) -> dict | bool:
    """oneOf [X1..Xn] = anyOf over i of (Xi and not Xj for each j that may overlap Xi). Pairs proved
    disjoint need no negation; a pair that may overlap needs an exact negation, else the whole is refused."""
    from grammar.spec import GrammarError

    branches = n.list_of("oneOf", value, where)
    facts = [_facts(n, sub, child_pointer(where, i), base, _Facts()) for i, sub in enumerate(branches)]
    overlaps = {i: [j for j in range(len(branches)) if j != i and not _disjoint(facts[i], facts[j])]
                for i in range(len(branches))}
    if any(overlaps.values()) and len(branches) > n.limits.max_one_of_overlaps:
        raise schema_error(where, f"oneOf with {len(branches)} branches that may overlap, over the limit of "
                                  f"{n.limits.max_one_of_overlaps} (GrammarLimits.max_one_of_overlaps)")
    negations: dict[tuple[int, int], Any] = {}
    out = []
    for i, sub in enumerate(branches):
        parts = [n.node(sub, child_pointer(where, i), base)]
        for j in overlaps[i]:
            if (i, j) not in negations:
                try:
                    negations[(i, j)] = negate(n, branches[j], child_pointer(where, j), base,
                                          within=frozenset(facts[i].kinds))
                except GrammarError as e:
                    raise schema_error(where, f"oneOf branches {i} and {j} may both match one instance (no distinct "
                                              "type, const/enum discriminator, or property one requires and the other "
                                              f"forbids), and branch {j} has no exact negation to exclude it: refused "
                                              f"rather than enforced as anyOf ({e})") from None
            parts.extend(_and_not(facts[i], None, negations[(i, j)])[1:])
        out.append(_all(parts))
    n.report.rewrites["oneOf -> exclusive anyOf" if negations else "oneOf -> anyOf"] += 1
    return _any(out)


# ----- not ------------------------------------------------------------------------------------------


def negate(n: Normalizer, raw: Any, where: str, base: str, depth: int = 0,
           within: frozenset[str] = _ALL_KINDS) -> dict | bool:
    """A schema admitting exactly the instances `raw` rejects, among instances of the kinds `within`
    (the caller conjoins the result with a schema that admits no other kind)."""
    if depth > n.limits.max_ref_depth:
        raise schema_error(where, f"'not' nested deeper than the limit of {n.limits.max_ref_depth}")
    if isinstance(raw, bool):
        return not raw
    if not isinstance(raw, dict):
        raise schema_error(where, "'not' must hold a schema")
    raw, where, base = n.resolve(raw, where, base)
    if isinstance(raw, bool):
        return not raw
    if "$ref" in raw:  # 2019-09+: a $ref with siblings is their conjunction
        target = n.refs.resolve(raw["$ref"], n.refs.base_of(raw, base), child_pointer(where, "$ref"))
        rest = {k: v for k, v in raw.items() if k != "$ref"}
        return _any([negate(n, target[0], target[1], target[2], depth + 1, within),
                     negate(n, rest, where, base, depth + 1, within)])
    if not _facts(n, raw, where, base, _Facts()).kinds & within:
        return True  # among the kinds that matter, raw admits nothing
    branches: list[Any] = []  # not(k1 and k2 ...) = not k1 or not k2 ...
    for key, value in raw.items():
        at = child_pointer(where, key)
        if key not in VALIDATION:
            continue
        applies = _KEYWORD_TYPES.get(key)
        if applies is not None and not _KINDS[applies] & within:
            continue  # the keyword holds for every instance that matters: its negation admits none
        if key == "type":
            names = value if isinstance(value, list) else [value]
            kinds = set().union(*(_KINDS.get(t, set()) for t in names if t in TYPES))
            branches.append(_complement_kinds(set(within) - kinds, at, within))
        elif key in _FLIP:
            low = key in ("minimum", "exclusiveMinimum")
            if isinstance(value, bool):
                continue  # draft-04 flag: read with its bound below
            flipped, delta = _FLIP[key]
            if (n.dialect == "draft4" and key in ("minimum", "maximum")
                    and raw.get("exclusiveMinimum" if low else "exclusiveMaximum") is True):
                flipped = "maximum" if low else "minimum"
            bound = value + delta
            if delta < 0 and bound < 0:
                branches.append(False)
                continue
            branches.append({"type": _APPLIES_TO[key], flipped: bound})
        elif key == "required":
            branches.extend({"type": "object", "properties": {name: False}} for name in value)
        elif key in ("const", "enum"):
            values = [value] if key == "const" else value
            branches.append(_not_values(values, at))
        elif key == "properties" and isinstance(value, dict):
            for name, sub in value.items():
                negated = negate(n, sub, child_pointer(at, name), base, depth + 1)
                if negated is not False:
                    branches.append({"type": "object", "required": [name], "properties": {name: negated}})
        elif key == "anyOf":
            branches.append(_all([negate(n, s, child_pointer(at, i), base, depth + 1, within)
                                  for i, s in enumerate(value)]))
        elif key == "allOf":
            branches.extend(negate(n, s, child_pointer(at, i), base, depth + 1, within) for i, s in enumerate(value))
        elif key == "oneOf":
            branches.append(_not_one_of(n, value, at, base, depth, within))
        elif key == "not":
            branches.append(n.node(value, at, base))
        elif key in ("$defs", "definitions", "then", "else", "additionalItems"):
            continue
        else:
            raise schema_error(at, f"'not' of {key!r} has no exact positive form the grammar can enforce: refused "
                                   "rather than ignored")
    if not [k for k in raw if k in VALIDATION and k not in ("$defs", "definitions")]:
        return False  # not {} admits nothing
    return _any(branches)


def _not_one_of(n: Normalizer, value: Any, where: str, base: str, depth: int, within: frozenset[str]) -> Any:
    """not oneOf [X1..Xn] = none of them, or two (that may overlap) at once."""
    subs = n.list_of("oneOf", value, where)
    facts = [_facts(n, sub, child_pointer(where, i), base, _Facts()) for i, sub in enumerate(subs)]
    none = _all([negate(n, s, child_pointer(where, i), base, depth + 1, within) for i, s in enumerate(subs)])
    pairs = [_all([n.node(subs[i], child_pointer(where, i), base), n.node(subs[j], child_pointer(where, j), base)])
             for i in range(len(subs)) for j in range(i + 1, len(subs)) if not _disjoint(facts[i], facts[j])]
    return _any([none, *pairs])


def _complement_kinds(kinds: set[str], where: str, within: frozenset[str] = _ALL_KINDS) -> dict | bool:
    if kinds == set(within):
        return True
    try:
        return _only(kinds)
    except ValueError:
        raise schema_error(where, "'not' of this type leaves non-integer numbers only, which no type "
                                  "expresses: refused") from None


def _not_values(values: list, where: str) -> dict | bool:
    """Everything except `values` (scalars): per kind, the kind minus the listed values."""
    by_kind: dict[str, list] = {}
    for v in values:
        kind = _kind_of(v)
        if kind in ("object", "array"):
            raise schema_error(where, "'not' of an object or array value has no positive form the grammar can "
                                      "enforce: refused")
        by_kind.setdefault("number" if kind in ("integer", "fraction") else kind, []).append(v)
    untouched = {k for k in _ALL_KINDS if k not in by_kind and not (k in ("integer", "fraction") and "number" in by_kind)}
    branches: list[Any] = [_only(untouched)]
    if "string" in by_kind:
        branches.append({"type": "string", "pattern": complement_regex(by_kind["string"])})
    if "boolean" in by_kind and len(set(by_kind["boolean"])) == 1:
        branches.append({"const": not by_kind["boolean"][0]})
    if "number" in by_kind:
        points = sorted(set(by_kind["number"]))
        branches.append({"type": "number", "exclusiveMaximum": points[0]})
        branches.extend({"type": "number", "exclusiveMinimum": lo, "exclusiveMaximum": hi}
                        for lo, hi in zip(points, points[1:], strict=False))
        branches.append({"type": "number", "exclusiveMinimum": points[-1]})
    return _any(branches)


def complement_regex(words: list[str]) -> str:
    """An anchored regex matching every string except `words` (a trie, complemented node by node)."""
    trie: dict = {}
    for word in set(words):
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def other(node: dict) -> str:
        alternatives = [] if "" in node else [""]  # stopping here is a different string
        children = sorted(c for c in node if c)
        if children:
            cls = "".join("\\" + c if c in "\\]^-[&~|" else c for c in children)
            alternatives.append(f"[^{cls}]{_ANY}*")
            alternatives.extend(escape_regex_literal(c) + other(node[c]) for c in children)
        else:
            alternatives.append(f"{_ANY}+")
        return "(?:" + "|".join(alternatives) + ")"

    return "^" + other(trie) + "$"


def _any(branches: list[Any]) -> dict | bool:
    branches = [b for b in branches if b is not False]
    if any(b is True or b == {} for b in branches):
        return True
    if not branches:
        return False
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _all(parts: list[Any]) -> dict | bool:
    if any(p is False for p in parts):
        return False
    parts = [p for p in parts if p is not True and p != {}]
    if not parts:
        return True
    return parts[0] if len(parts) == 1 else {"allOf": parts}


# ----- if / then / else -----------------------------------------------------------------------------


def if_then_else(n: Normalizer, raw: dict, pointer: str, base: str) -> dict | bool:
    where = child_pointer(pointer, "if")
    has_then, has_else = "then" in raw, "else" in raw
    if not has_then and not has_else:
        return True  # "if" alone asserts nothing
    condition = n.node(raw["if"], where, base)
    then = n.node(raw["then"], child_pointer(pointer, "then"), base) if has_then else True
    otherwise = n.node(raw["else"], child_pointer(pointer, "else"), base) if has_else else True
    n.report.rewrites["if/then/else"] += 1
    return _any([_all([condition, then]), _all([negate(n, raw["if"], where, base), otherwise])])


# ----- propertyNames, unevaluatedProperties ---------------------------------------------------------


def property_names(n: Normalizer, raw: dict, value: Any, where: str, base: str, out: dict, conj: list) -> None:
    value, _, _ = n.resolve(value, where, base)
    if value is True:
        return
    if value is False:
        out["maxProperties"] = 0
        return
    keys = sorted(k for k in value if k in VALIDATION and not (k == "type" and value[k] == "string")) \
        if isinstance(value, dict) else []
    if not keys:
        return  # annotations only: every name passes
    if keys == ["format"] and value["format"] in ("regex",) and n.allow_approximate:
        n.report.approximations["propertyNames format regex"] += 1
        return
    if keys == ["pattern"]:
        pattern = value["pattern"]
        grammar_pattern = n.check_regex(pattern, child_pointer(where, "pattern"), approximate=True)
        try:
            compiled = re.compile(pattern)
        except re.error:
            raise schema_error(where, f"propertyNames pattern {pattern!r} uses syntax the grammar cannot check "
                                      "against the declared properties: refused") from None
        matches = lambda name: compiled.search(name) is not None  # noqa: E731
        pattern = grammar_pattern  # without look-around: a superset of names, which the output guard narrows
    elif set(keys) <= {"minLength", "maxLength"} or keys in (["enum"], ["const"]):
        # the names that fail are a regular set: forbid them, whatever else the object says
        if "enum" in value or "const" in value:
            names = [a for a in (value["enum"] if "enum" in value else [value["const"]]) if isinstance(a, str)]
            if not names:
                out["maxProperties"] = 0
                return
            failing = complement_regex(names)
        else:
            low, high = value.get("minLength", 0), value.get("maxLength")
            if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in (low, high or 0)):
                raise schema_error(where, "propertyNames lengths must be non-negative integers")
            alternatives = ([f"{_ANY}{{0,{low - 1}}}"] if low > 0 else []) + \
                ([f"{_ANY}{{{high + 1},}}"] if high is not None else [])
            if not alternatives:
                return
            failing = "^(?:" + "|".join(alternatives) + ")$"
        conj.append({"patternProperties": {failing: False}})
        n.report.rewrites["propertyNames"] += 1
        return
    else:
        raise schema_error(where, "keyword 'propertyNames' is enforced only as one pattern, length bounds, an enum or "
                                  f"a const of names: {keys} has no exact form the grammar can enforce")
    additional = raw.get("additionalProperties", True)
    if not raw.get("patternProperties") and not raw.get("properties") and additional not in (True, False, {}):
        # keys must match and get the additionalProperties schema: exactly patternProperties {pattern: it}
        out["patternProperties"] = {pattern: out.pop("additionalProperties", True)}
        out["additionalProperties"] = False
        n.report.rewrites["propertyNames"] += 1
        return
    if raw.get("patternProperties") or additional not in (True, False, {}):
        raise schema_error(where, "keyword 'propertyNames' next to patternProperties or an additionalProperties "
                                  "schema has no exact form the grammar can enforce: refused")
    props = dict(out.get("properties", {}))
    for name in list(props):
        if not matches(name):
            props[name] = False
    out["properties"] = props
    if additional is not False:
        conj.append({"patternProperties": {pattern: {}}, "additionalProperties": False,
                     "properties": {name: {} for name in props if matches(name)}})
    n.report.rewrites["propertyNames"] += 1


_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "$ref", "dependentSchemas", "dependencies", "$dynamicRef",
             "$recursiveRef")


def unevaluated_properties(n: Normalizer, raw: dict, value: Any, pointer: str, base: str, out: dict) -> None:
    where = child_pointer(pointer, "unevaluatedProperties")
    if value is True or "additionalProperties" in raw:
        return  # additionalProperties evaluates every property the others did not
    names: list[str] = []
    if not _collect_evaluated(n, raw, pointer, base, names, top=True):
        raise schema_error(where, "keyword 'unevaluatedProperties' next to applicators that may evaluate "
                                  "properties conditionally (anyOf, oneOf, if, patternProperties, ...) is not "
                                  f"supported: the {n.backend.name} backend would not enforce it")
    props = dict(out.get("properties", {}))
    for name in names:
        props.setdefault(name, True)
    out["properties"] = props
    out["additionalProperties"] = n.node(value, where, base)
    n.report.rewrites["unevaluatedProperties"] += 1


def _collect_evaluated(n: Normalizer, raw: Any, pointer: str, base: str, names: list[str], top: bool = False,
                       depth: int = 0) -> bool:
    """Add the property names `raw` (and its allOf / $ref, in place) evaluates; False if that is not a
    fixed set of names."""
    if depth > n.limits.max_ref_depth:
        return False
    if not isinstance(raw, dict):
        return True
    if not top and ("unevaluatedProperties" in raw or "additionalProperties" in raw):
        return False
    if raw.get("patternProperties") or any(k in raw for k in _IN_PLACE if k not in ("allOf", "$ref")):
        return False
    names.extend(raw.get("properties") or {})
    for i, sub in enumerate(raw.get("allOf") or []):
        if not _collect_evaluated(n, sub, child_pointer(pointer, f"allOf/{i}"), base, names, depth=depth + 1):
            return False
    if "$ref" in raw:
        target, at, inner = n.refs.resolve(raw["$ref"], n.refs.base_of(raw, base), child_pointer(pointer, "$ref"))
        return _collect_evaluated(n, target, at, inner, names, depth=depth + 1)
    return True


__all__ = ["KNOWN", "complement_regex", "dependencies", "if_then_else", "negate", "one_of", "property_names",
           "unevaluated_properties"]
