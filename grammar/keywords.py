"""The JSON Schema vocabulary as the grammar sees it: which keys are keywords, which hold subschemas,
which formats the specification defines, and how to spot a misspelt keyword.

The specification says an unknown keyword is an annotation: validators ignore it (draft 2020-12
§6.5; python-jsonschema does the same). So does the grammar, with one exception: a key that is
almost a validation keyword (the same ignoring case, or one edit away for names of five letters or
more: "maxitems", "patternPropertiez") is refused, since it most likely meant a constraint that would
otherwise constrain nothing. Keys with a vendor prefix ("_", "x-", "@") are always annotations.
"""

from __future__ import annotations

from typing import Literal

Dialect = Literal["draft4", "draft6", "draft7", "draft2019", "draft2020"]

# $schema URI (no trailing "#", no scheme) -> dialect; anything else counts as 2020-12, as python-jsonschema's
# validator_for does.
DIALECTS: dict[str, Dialect] = {
    "json-schema.org/draft-04/schema": "draft4",
    "json-schema.org/schema": "draft2020",
    "json-schema.org/draft-06/schema": "draft6",
    "json-schema.org/draft-07/schema": "draft7",
    "json-schema.org/draft/2019-09/schema": "draft2019",
    "json-schema.org/draft/2020-12/schema": "draft2020",
}


def dialect_of(schema: object) -> Dialect:
    """The draft `schema` is written in: its $schema; without one, the draft its forms belong to
    (boolean exclusiveMinimum: draft-04; dependencies, items as a list or additionalItems: draft-07),
    else 2020-12. The normalizer and the output guard read a schema in the same draft."""
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    if isinstance(uri, str):
        return DIALECTS.get(uri.split("://", 1)[-1].rstrip("#"), "draft2020")
    older: Dialect | None = None
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("exclusiveMinimum"), bool) or isinstance(node.get("exclusiveMaximum"), bool):
            return "draft4"
        if "dependencies" in node or isinstance(node.get("items"), list) or "additionalItems" in node:
            older = "draft7"
        for key, value in node.items():
            if key in SCHEMA_MAPS or key == "dependencies":
                if isinstance(value, dict):
                    stack.extend(value.values())
            elif key in SCHEMAS:
                stack.append(value)
            elif key in SCHEMA_LISTS or key == "items":
                stack.extend(value if isinstance(value, list) else [value])
    return older or "draft2020"


# Keys whose value is a map of name -> schema, a schema, or a list of schemas.
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
SCHEMAS = frozenset({"additionalProperties", "additionalItems", "items", "contains", "not", "if", "then", "else",
                     "propertyNames", "unevaluatedProperties", "unevaluatedItems"})
SCHEMA_LISTS = frozenset({"prefixItems", "anyOf", "oneOf", "allOf"})

COUNTS = frozenset({"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                    "minContains", "maxContains"})
NUMBERS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})

# Every keyword that constrains an instance, in any draft in use (04, 06, 07, 2019-09, 2020-12), plus the
# reference and identifier keywords. A key outside this set and ANNOTATIONS is an annotation.
VALIDATION = frozenset({
    *SCHEMA_MAPS, *SCHEMAS, *SCHEMA_LISTS, *COUNTS, *NUMBERS,
    "type", "enum", "const", "required", "pattern", "format", "uniqueItems", "dependencies",
    "dependentRequired", "$ref", "$dynamicRef", "$recursiveRef",
})
IDENTIFIERS = frozenset({"$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$schema", "$vocabulary"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "contentMediaType", "contentEncoding", "contentSchema"})
KNOWN = VALIDATION | IDENTIFIERS | ANNOTATIONS

TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})

# Formats the specification defines (2020-12 §7.3, and draft-04's set). A format outside this set is an
# annotation; one inside it is enforced or refused, never dropped.
SPEC_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex",
})

_NEAR_TARGETS = VALIDATION - {"definitions"}
_LOWER = {k.lower(): k for k in _NEAR_TARGETS}


def near_miss(key: str) -> str | None:
    """The validation keyword `key` was probably meant to be, or None. Only for keys not in KNOWN.
    Vendor prefixes ("_format", "x-maxItems", "@type") mark deliberate annotations: never a near miss."""
    if key in KNOWN or key.startswith(("_", "x-", "@")):
        return None
    exact = _LOWER.get(key.lower())
    if exact is not None:
        return exact
    if len(key) < 5:
        return None
    for keyword in sorted(_NEAR_TARGETS):
        if len(keyword) >= 5 and one_edit(key.lower(), keyword.lower()):
            return keyword
    return None


def one_edit(a: str, b: str) -> bool:
    """a and b differ by one insertion, deletion, substitution or swap of neighbours."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                                  and a[diff[1]] == b[diff[0]])
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    i = next((i for i in range(len(short)) if short[i] != long_[i]), len(short))
    return short[i:] == long_[i + 1:]
