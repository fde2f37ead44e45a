"""Where each `$ref` of one schema document points.

Resolves, against the base URI in force at the reference (RFC 3986), JSON-pointer fragments
("#/definitions/a", "other.json#/$defs/b" where other.json is an embedded `$id`), embedded resources
(`$id`, or `id` in draft-04), `$anchor`s and draft-04/06/07 plain-name fragments (`"$id": "#foo"`).
Nothing is fetched: a reference to a document that is not embedded is refused by name.
This object does not modify the schema.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from grammar.keywords import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMAS, Dialect
from grammar.spec import GrammarError

# The retrieval URI of a schema without a root $id: relative ids and refs resolve against it.
DEFAULT_BASE = "https://loraplex.invalid/schema.json"


def child_pointer(pointer: str, key: str | int) -> str:
    return f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}"


def schema_error(pointer: str, message: str) -> GrammarError:
    return GrammarError(f"json_schema at {pointer}: {message}")


class RefIndex:
    """The resources and anchors of one schema document, and `resolve` for its references.

    num_nodes: subschemas in the document (every object or boolean in a schema position).
    """

    def __init__(self, root: Any, dialect: Dialect) -> None:
        self.root = root
        self.id_key = "id" if dialect == "draft4" else "$id"
        self.plain_name_ids = dialect in ("draft4", "draft6", "draft7")
        self.resources: dict[str, tuple[Any, str]] = {}  # absolute URI (no fragment) -> (node, pointer)
        self.anchors: dict[str, tuple[Any, str, str]] = {}  # URI#name -> (node, pointer, base)
        self.num_nodes = 0
        self.root_base = self.base_of(root, DEFAULT_BASE)
        self.resources.setdefault(DEFAULT_BASE, (root, "#"))
        self._index(root, "#", DEFAULT_BASE)

    def base_of(self, node: Any, base: str) -> str:
        """The base URI inside `node`, given the one in force around it."""
        if isinstance(node, dict):
            ident = node.get(self.id_key)
            if isinstance(ident, str) and not ident.startswith("#"):
                return urldefrag(urljoin(base, ident))[0]
        return base

    def _index(self, node: Any, pointer: str, base: str) -> None:
        # NOTE: iterative: real schemas nest deeper than Python's recursion limit allows comfortably.
        stack = [(node, pointer, base)]
        while stack:
            node, pointer, base = stack.pop()
            self.num_nodes += 1
            if not isinstance(node, dict):
                continue
            inner = self.base_of(node, base)
            if inner != base or pointer == "#":
                self.resources.setdefault(inner, (node, pointer))
            ident = node.get(self.id_key)
            if self.plain_name_ids and isinstance(ident, str) and "#" in ident and len(ident.split("#", 1)[1]) > 0 \
                    and not ident.split("#", 1)[1].startswith("/"):
                uri, name = ident.split("#", 1)
                self.anchors.setdefault(f"{urljoin(inner, uri) if uri else inner}#{name}", (node, pointer, inner))
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(key), str):
                    self.anchors.setdefault(f"{inner}#{node[key]}", (node, pointer, inner))
            for key, value in node.items():
                where = child_pointer(pointer, key)
                if key in SCHEMA_MAPS or key == "dependencies":
                    if isinstance(value, dict):
                        stack.extend((sub, child_pointer(where, name), inner) for name, sub in value.items()
                                     if isinstance(sub, dict | bool))
                elif key in SCHEMAS and isinstance(value, dict | bool):
                    stack.append((value, where, inner))
                elif (key in SCHEMA_LISTS or key == "items") and isinstance(value, list):
                    stack.extend((sub, child_pointer(where, i), inner) for i, sub in enumerate(value))

    def resolve(self, ref: Any, base: str, where: str) -> tuple[Any, str, str]:
        """(target node, its pointer, the base URI inside it) for `ref` found at `where`. Raises GrammarError."""
        if not isinstance(ref, str):
            raise schema_error(where, f"'$ref' must be a string, got {ref!r}")
        uri, fragment = urldefrag(urljoin(base, ref))
        if uri not in self.resources:
            raise schema_error(where, f"remote $ref {ref!r} is not supported: nothing is fetched; embed the referenced "
                                      "schema under $defs and refer to it with '#/$defs/...'")
        node, pointer = self.resources[uri]
        fragment = unquote(fragment)
        if not fragment:
            return node, pointer, self.base_of(node, uri)
        if not fragment.startswith("/"):
            if f"{uri}#{fragment}" not in self.anchors:
                raise schema_error(where, f"unresolvable $ref {ref!r}: no anchor {fragment!r}")
            return self.anchors[f"{uri}#{fragment}"]
        target, inner = node, uri
        for part in fragment[1:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise schema_error(where, f"unresolvable $ref {ref!r}")
            inner = self.base_of(target, inner)
            pointer = child_pointer(pointer, part)
        return target, pointer, inner
