"""Indexes an enterprise already has, searched in place through a field mapping.

An *external* index is declared in the settings file; nothing is ever written to it:

    [indexes.corp]
    lexical = "elasticsearch"          # or "none"
    es_index = "corp-docs"
    dense = "milvus"                   # or "none"
    milvus_collection = "corp_vectors"
    [indexes.corp.fields]
    id = "doc_key"                     # document id (both backends)
    title = "headline"
    text = "body"
    acl = "groups"                     # keyword / array field of group names
    vector = "embedding"               # Milvus vector field

Text comes from the backend (`_source` in Elasticsearch, output fields in Milvus): there is no
local docstore. A document is one chunk, `"{id}#p0"`; `read_document` returns its text and the
agent's read tool windows it. The stores here satisfy the same small protocols as the owned ones
(`LexicalStore`, the dense `search(vector, …)`, the docstore's read methods), so the `Retriever`,
the agent and fusion run unchanged on top of them.

ACL, one rule for search and read by id: a document's groups are the values of its ACL field,
a null being no value; with none (the field missing, null, `[]`, `[null]`) it is public,
otherwise a caller sees it only when it holds one of its groups; `ACL_ALL` (an explicit admin
setting) sees everything. An empty or blank string is a group no caller can hold (admins only:
Elasticsearch indexes "" as a value, so `[""]` and `["a", ""]` cannot be told from a group in a
query), except in a Milvus VARCHAR field, one string per row, where "" is how a row has none.
The filter is part of the backend query, as for owned indexes. An index with both sides holds
each document's groups twice, and the two may disagree: it follows the stricter (`stricter`),
each side's hits checked against the other's record and every read taking both.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from branchsearch.infra.stores.acl import ACL_ALL, acl_visible, group_forms, group_name
from branchsearch.infra.stores.protocols import MAX_K, check_pattern, query_words, settled
from branchsearch.infra.stores.milvus import (milvus_call, milvus_error, milvus_list,
                                              quiet_pymilvus, server_answers, timeout_arg)
from branchsearch.infra.stores.milvus_lite import (acquire_lite, is_server, lite_key,
                                                   lite_log_dir, lite_spawn, log_lite_under,
                                                   release_lite, served_uri)
from branchsearch.infra.errors import BackendUnavailable, BadQuery, SettingsError, redact
from branchsearch.infra.stores.hits import Hit, doc_of


CHUNK_SUFFIX = "#p0"
# Milvus metrics whose `distance` is smaller for a nearer vector (COSINE and IP: larger); every
# ranking here orders by score, highest first, so their hits are scored by -distance
LOWER_IS_NEARER = ("L2", "HAMMING", "JACCARD")
# Elasticsearch field types whose `terms` query matches a group name exactly, as it is written
GROUP_TYPES = ("keyword", "constant_keyword", "wildcard")
_INT64 = re.compile(r"-?[0-9]{1,19}")  # a document id an integer id field can hold


@dataclass(frozen=True)
class FieldMap:
    """The backend's own field names for what branchsearch needs."""

    id: str = "id"
    title: str = "title"
    text: str = "text"
    acl: str = "acl"
    vector: str = "vector"


@dataclass(frozen=True)
class ExternalIndex:
    name: str
    lexical: str = "none"  # elasticsearch | none
    dense: str = "none"  # milvus | none
    es_index: str = ""
    es_url: str = ""  # default: the settings' es_url
    milvus_collection: str = ""
    milvus_uri: str = ""  # default: the settings' milvus_uri
    fields: FieldMap = field(default_factory=FieldMap)
    # what is wrong with its table (one line; "" when nothing): such an index cannot open, the
    # others still serve
    problem: str = ""

    def describe(self) -> str:
        if self.problem:
            return "misconfigured"
        parts = []
        if self.lexical == "elasticsearch":
            parts.append(f"elasticsearch:{self.es_index}")
        if self.dense == "milvus":
            parts.append(f"milvus:{self.milvus_collection}")
        return " + ".join(parts)


def parse_external(name: str, table: dict) -> ExternalIndex:
    """One `[indexes.NAME]` table → ExternalIndex; every mistake is one SettingsError line."""
    where = f"[indexes.{name}]"
    if not isinstance(table, dict):
        raise SettingsError(f"{where} must be a table")
    known = {f.name for f in fields(ExternalIndex)} - {"name", "problem"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise SettingsError(f"{where}: unknown keys {', '.join(unknown)} "
                            f"(known: {', '.join(sorted(known))})")
    raw_fields = table.get("fields", {})
    if not isinstance(raw_fields, dict):
        raise SettingsError(f"{where}.fields must be a table")
    field_names = {f.name for f in fields(FieldMap)}
    bad = sorted(set(raw_fields) - field_names)
    if bad:
        raise SettingsError(f"[indexes.{name}.fields]: unknown keys {', '.join(bad)} "
                            f"(known: {', '.join(sorted(field_names))})")
    values = {k: str(v) for k, v in table.items() if k != "fields"}
    spec = ExternalIndex(name=name, fields=FieldMap(**{k: str(v) for k, v in raw_fields.items()}),
                         **values)
    if spec.lexical not in ("elasticsearch", "none"):
        raise SettingsError(f"{where}: lexical must be \"elasticsearch\" or \"none\"")
    if spec.dense not in ("milvus", "none"):
        raise SettingsError(f"{where}: dense must be \"milvus\" or \"none\"")
    if spec.lexical == "none" and spec.dense == "none":
        raise SettingsError(f"{where}: needs lexical = \"elasticsearch\" or dense = \"milvus\"")
    if spec.lexical == "elasticsearch" and not spec.es_index:
        raise SettingsError(f"{where}: lexical = \"elasticsearch\" needs es_index")
    if spec.dense == "milvus" and not spec.milvus_collection:
        raise SettingsError(f"{where}: dense = \"milvus\" needs milvus_collection")
    from branchsearch.infra.config.settings import es_url_problem

    problem = es_url_problem(spec.es_url)
    if problem:
        raise SettingsError(f"setting {where} es_url: {problem}")
    return spec


def _misconfigured(name: str, table, problem: str) -> ExternalIndex:
    """A declared index whose table is wrong: it keeps its name and its error, and its URLs
    as written, so that their passwords are still masked in every message."""
    urls = {key: table[key] for key in ("es_url", "milvus_uri")
            if isinstance(table, dict) and isinstance(table.get(key), str)}
    return ExternalIndex(name=name, problem=problem, **urls)


def _parse_one(name: str, table) -> ExternalIndex:
    """`parse_external`, a mistake kept as the index's `problem` instead of raised: one bad
    table makes that index unusable, not every command on every index."""
    try:
        return parse_external(name, table)
    except SettingsError as exc:
        return _misconfigured(name, table, str(exc))


def parse_indexes(value) -> tuple[ExternalIndex, ...]:
    """The settings' `indexes`: a TOML table of tables, or what `parse_indexes` returned (as
    dataclasses or as the dicts `dataclasses.asdict` makes of them)."""
    if isinstance(value, dict):
        from branchsearch.infra.config.settings import index_name_problem

        for name in value:  # a name no `--index` could select: nothing to report it under
            problem = index_name_problem(str(name))
            if problem:
                raise SettingsError(f"[indexes.NAME] in the settings file: {problem}")
        return tuple(_parse_one(str(name), table) for name, table in value.items())
    if isinstance(value, str):  # an environment variable: a table has no one-line form
        raise SettingsError("indexes: declare external indexes as [indexes.NAME] tables in a "
                            "settings file, not in one string")
    out = []
    for item in value or ():
        if isinstance(item, ExternalIndex):
            out.append(item)
        elif isinstance(item, dict) and item.get("problem"):  # `asdict` of a misconfigured one
            out.append(_misconfigured(str(item["name"]), item, str(item["problem"])))
        elif isinstance(item, dict) and "name" in item:
            table = {k: v for k, v in item.items() if k not in ("name", "problem")}
            out.append(_parse_one(str(item["name"]), table))
        else:
            raise SettingsError(f"indexes: cannot read {item!r}")
    return tuple(out)


def _sees_all(acl_groups: Sequence[str] | None) -> bool:
    return acl_groups is not None and ACL_ALL in acl_groups


def stricter(groups: Sequence[str], other: Sequence[str]) -> list[str]:
    """The groups of a document whose two stores name `groups` and `other`: one side public,
    the other's; both restricted, the groups both name, and when they share none `[""]`, a
    group no caller holds (admins only). A caller seeing the result sees it on both sides."""
    if not groups or not other:
        return list(groups or other)
    names = {group_name(g) for g in other} - {""}
    return [g for g in groups if group_name(g) in names] or [""]


def _peer_checked(search):
    """A side's `search` / `grep` whose hits the other side of the index (`self.peer`) must
    also let the caller see: a document one store restricts is not shown by the other."""
    @functools.wraps(search)
    def wrapper(self, query, k: int, exclude_ids: Sequence[str] = (),
                acl_groups: Sequence[str] | None = None) -> list[Hit]:
        hits = search(self, query, k, exclude_ids, acl_groups)
        if self.peer is None or not hits or _sees_all(acl_groups):
            return hits
        records = self.peer.get([h.doc_id for h in hits])
        kept = [h for h in hits if h.doc_id not in records
                or acl_visible(records[h.doc_id]["acl"], acl_groups)]
        for rank, h in enumerate(kept, start=1):
            h.rank = rank
        return kept
    return wrapper


def _read_only(name: str):
    raise BadQuery(f"index {name!r} is external: branchsearch never writes to it")


# --- Elasticsearch ----------------------------------------------------------------------------


class ExternalElastic:
    """BM25 (`multi_match` over the mapped title and text), term regexes and reads by id on an
    existing Elasticsearch index; satisfies `LexicalStore` minus writing."""

    peer = None  # the index's Milvus side, when it has one: its groups count too

    def __init__(self, spec: ExternalIndex, url: str, *, api_key: str | None = None,
                 max_pattern: int = 200, timeout_s: float = 30):
        from elasticsearch import Elasticsearch

        if not url:
            raise SettingsError(f"index {spec.name!r}: lexical = \"elasticsearch\" needs es_url "
                                f"(in [indexes.{spec.name}] or BRANCHSEARCH_ES_URL)")
        self.spec, self.f, self.url, self.max_pattern = spec, spec.fields, url, max_pattern
        self.index = spec.es_index
        self._es = Elasticsearch(url, api_key=api_key, request_timeout=timeout_s)
        try:
            exists = self._es.indices.exists(index=self.index)
        except Exception as exc:
            raise _es_unavailable(url, exc) from None
        if not exists:
            raise SettingsError(f"index {spec.name!r}: Elasticsearch index {self.index!r} does "
                                f"not exist at {redact(url)}")
        try:
            mapping = self._es.indices.get_mapping(index=self.index)
        except Exception as exc:
            raise _es_unavailable(url, exc) from None
        where = f"Elasticsearch index {self.index!r}"
        types, aliases = _mapped(mapping), _aliases(mapping)
        _check_mapped(spec, where, set(types), ("id", "text", "acl"))
        # a field alias is searched and read as the field it points to: `_source` holds the
        # values under that field's name, never the alias's (read as missing: public)
        self.f = FieldMap(**{role: aliases.get(getattr(self.f, role), getattr(self.f, role))
                             for role in ("id", "title", "text", "acl", "vector")})
        for concrete, body in dict(mapping).items():  # an alias: every index behind it
            here = where if len(mapping) == 1 else (f"Elasticsearch index {concrete!r} (behind "
                                                   f"{self.index!r})")
            _check_acl_mapping(spec, self.f.acl, {concrete: body}, here)
        # where each field's value is in a document's `_source` ("groups.keyword" is indexed
        # from "groups"); the queries name the indexed fields, `self.f`
        self.src = FieldMap(**{role: _source_path(getattr(self.f, role), types)
                               for role in ("id", "title", "text", "acl", "vector")})
        unread = _not_in_source(mapping, self.f.acl, self.src.acl) if self.f.acl else ""
        if unread:  # searched by its indexed values, read by id from `_source`: public there
            raise SettingsError(
                f"index {spec.name!r}: field acl = {spec.fields.acl!r} {unread} in {where}: a "
                "document read by id would read as public; map acl to a field whose groups "
                "each document's _source holds")

    # the id may be Elasticsearch's own `_id` or a field of the document
    def _ids_query(self, doc_ids: Sequence[str]) -> dict:
        if self.f.id == "_id":
            return {"ids": {"values": list(doc_ids)}}
        return {"terms": {self.f.id: list(doc_ids)}}

    def _acl_filter(self, acl_groups) -> list[dict]:
        if _sees_all(acl_groups) or not self.f.acl:  # acl = "": no groups, all public
            return []
        public = {"bool": {"must_not": [{"exists": {"field": self.src.acl}}]}}
        if not acl_groups:
            return [public]
        return [{"bool": {"should": [public, {"terms": {self.f.acl: group_forms(acl_groups)}}],
                          "minimum_should_match": 1}}]

    def _run(self, must: dict, k: int, exclude_ids: Sequence[str], acl_groups,
             source: str) -> list[Hit]:
        query: dict = {"bool": {"must": [must], "filter": self._acl_filter(acl_groups)}}
        if exclude_ids:
            query["bool"]["must_not"] = [self._ids_query([doc_of(c) for c in exclude_ids])]
        try:
            result = self._es.search(index=self.index, query=query, size=k,
                                     source_includes=self._source_fields())
        except Exception as exc:
            if getattr(getattr(exc, "meta", None), "status", None) == 400:
                raise BadQuery(f"elasticsearch rejected the {source} query: {exc}") from None
            raise _es_unavailable(self.url, exc) from None
        return [self._hit(h, rank, source) for rank, h in
                enumerate(result["hits"]["hits"], start=1)]

    def _source_fields(self) -> list[str]:
        return [n for n in (self.src.id, self.src.title, self.src.text, self.src.acl)
                if n and n != "_id"]

    def _doc_id(self, h: dict) -> str:
        if self.f.id == "_id":
            return str(h["_id"])
        return str(_value(h["_source"], self.src.id, h["_id"]))

    def _hit(self, h: dict, rank: int, source: str) -> Hit:
        doc_id = self._doc_id(h)
        src = h["_source"]
        return Hit(doc_id + CHUNK_SUFFIX, doc_id, float(h.get("_score") or 0.0), rank, source,
                   text=str(_value(src, self.src.text, "")),
                   title=str(_value(src, self.src.title, "")))

    @_peer_checked
    @settled
    def search(self, query: str, k: int, exclude_ids: Sequence[str] = (),
               acl_groups: Sequence[str] | None = None) -> list[Hit]:
        words = query_words(query)
        if not words or k <= 0:
            return []
        must = {"multi_match": {"query": " ".join(words),
                                "fields": [self.f.title, self.f.text]}}
        return self._run(must, k, exclude_ids, acl_groups, "bm25")

    @_peer_checked
    @settled
    def grep(self, pattern: str, k: int, exclude_ids: Sequence[str] = (),
             acl_groups: Sequence[str] | None = None) -> list[Hit]:
        pattern = check_pattern(pattern, self.max_pattern)
        must = {"regexp": {self.f.text: {"value": pattern, "flags": "NONE",
                                         "max_determinized_states": 10000}}}
        return self._run(must, k, exclude_ids, acl_groups, "grep")

    def get(self, doc_ids: Sequence[str]) -> dict[str, dict]:
        """doc id -> {doc_id, title, text, acl} for the ids that exist (no ACL filter: the
        retriever checks each record's `acl` against the caller before showing it)."""
        if not doc_ids:
            return {}
        try:
            result = self._es.search(index=self.index, query=self._ids_query(doc_ids),
                                     size=len(doc_ids), source_includes=self._source_fields())
        except Exception as exc:
            raise _es_unavailable(self.url, exc) from None
        return {self._doc_id(h): _record(self._doc_id(h), h["_source"], self.src)
                for h in result["hits"]["hits"]}

    def write(self, *args, **kwargs):
        _read_only(self.spec.name)

    def count(self) -> int:
        try:
            return int(self._es.count(index=self.index)["count"])
        except Exception as exc:
            raise _es_unavailable(self.url, exc) from None

    def shard_stats(self) -> dict | int:
        """The index's stats per shard (`infra.index.fingerprint`), or the HTTP status with
        which the cluster refused them (401/403: they need the `monitor` privilege, searching
        does not; a proxy or a serverless project may not serve `_stats` at all). Raised only
        when the cluster does not answer."""
        try:
            return self._es.indices.stats(index=self.index, level="shards").body
        except Exception as exc:
            status = getattr(getattr(exc, "meta", None), "status", None)
            if isinstance(status, int) and status >= 400:
                return status
            raise _es_unavailable(self.url, exc) from None

    def close(self) -> None:
        self._es.close()


def _mapped(mapping) -> dict[str, str]:
    """Every field name an Elasticsearch mapping (of one index or several: an alias) holds,
    objects' fields dotted ("meta.groups") and multi-fields too ("groups.keyword"), with its
    type ("object" for an object)."""
    names: dict[str, str] = {}

    def walk(properties: dict | None, prefix: str) -> None:
        for name, spec in (properties or {}).items():
            names[prefix + name] = spec.get("type", "object")
            names.update({f"{prefix}{name}.{sub}": sub_spec.get("type", "")
                          for sub, sub_spec in (spec.get("fields") or {}).items()})
            walk(spec.get("properties"), f"{prefix}{name}.")

    for body in dict(mapping).values():
        walk((body.get("mappings") or {}).get("properties"), "")
    return names


def _check_acl_mapping(spec: ExternalIndex, acl: str, mapping, where: str) -> None:
    """The ACL field `acl` (an alias already read as its target) in the mapping of one
    concrete index: present, a keyword field (not analysed, not an object), not normalised.
    Behind an alias each index maps its own fields, so each is checked: one whose field is
    text would match a group word by word, one without it would read every document of its
    own as public."""
    if not acl:  # acl = "": no groups, all public
        return
    types = _mapped(mapping)
    if acl not in types:
        raise SettingsError(
            f"index {spec.name!r}: field acl = {spec.fields.acl!r} is not in {where}: each of "
            f"its documents would read as public; map {acl!r} in that index too (as keyword)")
    if types[acl] == "text":  # analysed: matched word by word
        keyword = [n for n, t in types.items() if n.startswith(f"{acl}.") and t == "keyword"]
        use = f"acl = {keyword[0]!r}" if keyword else "a keyword field"
        raise SettingsError(
            f"index {spec.name!r}: field acl = {spec.fields.acl!r} is a text field in {where}: "
            f"its group names would match word by word (a caller of 'eu' would see "
            f"'finance-eu'); map the groups as keyword, or use {use} in "
            f"[indexes.{spec.name}.fields]")
    if types[acl] not in GROUP_TYPES:  # an object: its sub-fields' names read as groups
        inner = [n for n, t in types.items() if n.startswith(f"{acl}.") and t in GROUP_TYPES]
        use = f"acl = {inner[0]!r}" if inner else "a keyword field"
        raise SettingsError(
            f"index {spec.name!r}: field acl = {spec.fields.acl!r} is of type {types[acl]!r} in "
            f"{where}; the group names must be a keyword field: use {use} in "
            f"[indexes.{spec.name}.fields]")
    ignore_above = _field_spec(mapping, acl).get("ignore_above")
    if ignore_above is not None and _source_path(acl, types) == acl:
        raise SettingsError(  # a longer group is not indexed: `exists` misses it, so public
            f"index {spec.name!r}: field acl = {spec.fields.acl!r} has ignore_above = "
            f"{ignore_above} in {where}: a document whose group is longer is indexed without "
            "it and would read as public; map the groups as a keyword field without "
            "ignore_above")
    normalizer = _field_spec(mapping, acl).get("normalizer")
    if normalizer:  # "HR" indexed as "hr": a caller of group 'hr' would match 'HR'
        raise SettingsError(
            f"index {spec.name!r}: field acl = {spec.fields.acl!r} has the normalizer "
            f"{normalizer!r} in {where}: group names would match as it normalises them (a "
            "caller of 'hr' would see 'HR''s documents); map the groups as a keyword "
            "field without a normalizer")
    null_value = _field_spec(mapping, acl).get("null_value")
    if null_value is not None:  # a null indexed as a group: `_source` still holds the null
        raise SettingsError(
            f"index {spec.name!r}: field acl = {spec.fields.acl!r} has null_value = "
            f"{null_value!r} in {where}: search would restrict a document whose groups are null "
            "to that group while a read by id shows it to everyone; map the groups as a keyword "
            "field without null_value")


def _aliases(mapping) -> dict[str, str]:
    """Each field alias of a mapping (`{"type": "alias", "path": …}`, dotted names as in
    `_mapped`) -> the field it points to."""
    out: dict[str, str] = {}

    def walk(properties: dict | None, prefix: str) -> None:
        for name, spec in (properties or {}).items():
            if spec.get("type") == "alias" and spec.get("path"):
                out[prefix + name] = str(spec["path"])
            walk(spec.get("properties"), f"{prefix}{name}.")

    for body in dict(mapping).values():
        walk((body.get("mappings") or {}).get("properties"), "")
    return out


def _field_spec(mapping, name: str) -> dict:
    """The mapping of field `name` (dotted as in `_mapped`: an object's field, a multi-field);
    {} when no index of `mapping` has it."""
    for body in dict(mapping).values():
        properties, spec = (body.get("mappings") or {}).get("properties") or {}, None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if spec is not None and part in (spec.get("fields") or {}) and i == len(parts) - 1:
                spec = spec["fields"][part]
                break
            spec = properties.get(part)
            if spec is None:
                break
            properties = spec.get("properties") or {}
        if spec is not None:
            return spec
    return {}


def _not_in_source(mapping, field: str, path: str) -> str:
    """Why a document's `_source` does not hold the values Elasticsearch indexes in `field`
    (stored at `path` of `_source`), "" when it does: `field` is filled by `copy_to` from
    other fields, or `_source` is disabled or excludes `path`."""
    from fnmatch import fnmatchcase

    copied: list[str] = []

    def walk(properties: dict | None, prefix: str) -> None:
        for name, spec in (properties or {}).items():
            for sub, sub_spec in [("", spec), *((f".{n}", s) for n, s in
                                                (spec.get("fields") or {}).items())]:
                targets = sub_spec.get("copy_to") or []
                if field in ([targets] if isinstance(targets, str) else targets):
                    copied.append(prefix + name + sub)
            walk(spec.get("properties"), f"{prefix}{name}.")

    heads = [".".join(path.split(".")[:i]) for i in range(1, path.count(".") + 2)]
    for body in dict(mapping).values():
        mappings = body.get("mappings") or {}
        walk(mappings.get("properties"), "")
        source = mappings.get("_source") or {}
        if source.get("enabled") is False or str(source.get("enabled")).lower() == "false":
            return "is not in _source (_source is disabled)"
        excludes, includes = source.get("excludes") or [], source.get("includes") or []
        if any(fnmatchcase(h, p) for h in heads for p in excludes) or includes and not any(
                fnmatchcase(h, p) for h in heads for p in includes):
            return f"is not in _source ({path!r} is excluded from it)"
    if copied:
        return f"is filled by copy_to from {', '.join(map(repr, sorted(set(copied))))}"
    return ""


def _source_path(name: str, types: dict[str, str]) -> str:
    """Where a mapped field's value is in `_source`: a multi-field's ("groups.keyword") is its
    parent's ("groups"); an object's field ("meta.groups") is itself."""
    parent = name.rpartition(".")[0]
    return parent if types.get(parent, "object") not in ("object", "nested") else name


def _value(source: dict, path: str, default=None):
    """A field of a document: "meta.groups" is `{"meta": {"groups": …}}` or a key of that name."""
    if path in source:
        return source[path]
    head, dot, rest = path.partition(".")
    if dot and isinstance(source.get(head), dict):
        return _value(source[head], rest, default)
    return default


def _check_mapped(spec: ExternalIndex, where: str, present: set[str],
                  roles: tuple[str, ...]) -> None:
    """Each mapped field of `roles` is one the backend has (Elasticsearch's own `_id` always
    is). The ACL field above all: a misspelt one would make every document public, since a
    document without groups is public; `acl = ""` says the documents have none."""
    for role in roles:
        name = getattr(spec.fields, role)
        if role == "acl" and not name or name == "_id" or name in present:
            continue
        hint = (f"; if its documents have no groups (every one public), set acl = \"\" in "
                f"[indexes.{spec.name}.fields]" if role == "acl" else "")
        shown = sorted(present)
        more = f", … ({len(shown)} fields)" if len(shown) > 20 else ""
        raise SettingsError(f"index {spec.name!r}: field {role} = {name!r} is not in {where} "
                            f"(it has {', '.join(shown[:20])}{more}){hint}")


def _es_unavailable(url: str, exc: Exception) -> BackendUnavailable:
    url = redact(url)  # an error line is shown and logged: no credentials in it
    status = getattr(getattr(exc, "meta", None), "status", None)
    if status:
        return BackendUnavailable(f"elasticsearch at {url}: {status} {exc}")
    return BackendUnavailable(f"elasticsearch at {url} is not reachable ({type(exc).__name__});"
                              " start it or fix es_url")


# --- Milvus -------------------------------------------------------------------------------------


def _check_milvus_id(spec: ExternalIndex, where: str, field: dict) -> bool:
    """Whether the id field holds integers (an INT64 primary key, as many collections have);
    a field neither text nor integer cannot name a document."""
    from pymilvus import DataType

    kind = field.get("type")
    if kind == DataType.VARCHAR:
        return False
    if kind in (DataType.INT8, DataType.INT16, DataType.INT32, DataType.INT64):
        return True
    raise SettingsError(f"index {spec.name!r}: field id = {spec.fields.id!r} is "
                        f"{_type_name(kind)} in {where}; a document id must be a VARCHAR or an "
                        "integer field")


def _type_name(data_type) -> str:
    return str(getattr(data_type, "name", data_type))


def _check_milvus_acl(spec: ExternalIndex, where: str, field: dict) -> None:
    """The ACL filter compares group names as strings (`groups == ""`, `groups in [...]`) or
    as an array of them (`array_contains_any`): a field of another type (JSON, a number) fails
    every search in Milvus's parser, so it is refused at open, saying what it is."""
    from pymilvus import DataType

    kind, element = field.get("type"), field.get("element_type")
    if kind == DataType.VARCHAR or kind == DataType.ARRAY and element == DataType.VARCHAR:
        return
    shown = _type_name(kind) + (f" of {_type_name(element)}" if kind == DataType.ARRAY else "")
    raise SettingsError(
        f"index {spec.name!r}: field acl = {spec.fields.acl!r} is {shown} in {where}; the group "
        "names must be a VARCHAR field or an ARRAY of VARCHAR (acl = \"\" when the documents "
        "have no groups)")


class ExternalMilvus:
    """Vector search and reads by id on an existing Milvus collection, through the mapping.
    The query embedder must make vectors of the collection's dimension (checked here). A
    caller checks first that a Milvus server takes connections (`milvus.server_answers`),
    before it loads the embedder: a refused address then fails at once, where the client
    would wait out its whole timeout. `logs`: the folder a Milvus Lite server started for a
    file writes its glog files in (None: glog's default, /tmp)."""

    peer = None  # the index's Elasticsearch side, when it has one: its groups count too

    def __init__(self, spec: ExternalIndex, uri: str, embed_dim: int | None, *, token: str = "",
                 timeout_s: float = 30.0, logs: Path | None = None):
        from pymilvus import MilvusClient

        self.timeout_s, self._lite = timeout_s, lite_key(uri) if uri else None
        log_lite_under(self._lite, logs)
        if not uri:
            raise SettingsError(f"index {spec.name!r}: dense = \"milvus\" needs milvus_uri "
                                f"(in [indexes.{spec.name}] or BRANCHSEARCH_MILVUS_URI)")
        self.spec, self.f, self.uri = spec, spec.fields, uri
        self.collection = spec.milvus_collection
        quiet_pymilvus()
        wait = timeout_arg(timeout_s)
        try:
            served = served_uri(uri)  # another process owns the Lite file (a batch's)
            with lite_spawn(None if served else self._lite):  # ^C is its owner's to handle
                self._client = MilvusClient(uri=served or uri, token=token, timeout=wait)
            if not served:
                acquire_lite(uri)
            exists = self._client.has_collection(self.collection, timeout=wait)
        except Exception as exc:
            raise BackendUnavailable(f"milvus at {redact(uri)} is not reachable "
                                     f"({milvus_error(exc)})") from None
        try:
            if not exists:
                raise SettingsError(f"index {spec.name!r}: Milvus collection "
                                    f"{self.collection!r} does not exist at {redact(uri)}")
            described = self._request(f"describe {self.collection!r}",
                                      self._client.describe_collection, self.collection)
            schema = {f["name"]: f for f in described["fields"]}
            self._check_fields(schema, embed_dim)
            from pymilvus import DataType

            self._acl_is_array = schema.get(self.f.acl, {}).get("type") == DataType.ARRAY
            self._nearer_is_lower = self._metric() in LOWER_IS_NEARER
            self._request(f"load {self.collection!r}", self._client.load_collection,
                          self.collection)
        except BaseException:
            self.close()  # a refused open must not keep the Lite file from other processes
            raise

    def _check_fields(self, schema: dict, embed_dim: int | None) -> None:
        """The mapped fields against the collection's schema; `embed_dim` None: the collection
        is opened for its records only (the groups of a hybrid index's bm25 search), no
        query is embedded, so the vector's dimension is not compared."""
        name = self.spec.name
        where = f"Milvus collection {self.collection!r}"
        _check_mapped(self.spec, where, set(schema), ("id", "vector", "text"))
        vector = schema[self.f.vector]
        if "dim" not in (vector.get("params") or {}):  # a scalar or a sparse field
            raise SettingsError(
                f"index {name!r}: field vector = {self.f.vector!r} is not a dense vector field "
                f"in {where} (it is {_type_name(vector.get('type'))}); map vector to the field "
                "the collection's embeddings are in")
        dim = int(vector["params"]["dim"])
        if embed_dim is not None and dim != embed_dim:
            raise SettingsError(
                f"index {name!r}: collection {self.collection!r} holds {dim}-dim vectors in "
                f"{self.f.vector!r} but the query embedder makes {embed_dim}-dim ones; set "
                "embed_model to the model that embedded the collection")
        _check_mapped(self.spec, where, set(schema), ("acl",))
        if self.f.acl:
            _check_milvus_acl(self.spec, where, schema[self.f.acl])
        self._id_is_int = _check_milvus_id(self.spec, where, schema[self.f.id])
        self._outputs = [c for c in (self.f.id, self.f.title, self.f.text, self.f.acl)
                         if c in schema]

    def _metric(self) -> str:
        """The metric of the vector field's index. A collection without one cannot be searched
        (Milvus Lite loads it and fails each search; a server refuses to load it): refused
        here, since branchsearch never builds an index on a collection it does not own."""
        names = self._request(f"list indexes of {self.collection!r}", self._client.list_indexes,
                              self.collection, field_name=self.f.vector)
        if not names:
            raise SettingsError(
                f"index {self.spec.name!r}: Milvus collection {self.collection!r} has no index "
                f"on its vector field {self.f.vector!r}, so Milvus cannot search it; its owner "
                "must create one (FLAT, HNSW, IVF_FLAT, …)")
        index = self._request(f"describe index {names[0]!r}", self._client.describe_index,
                              self.collection, names[0])
        return str(index.get("metric_type", "")).upper()

    def _filters(self, exclude: Sequence[str], acl_groups) -> str:
        parts = []
        if not _sees_all(acl_groups) and self.f.acl in self._outputs:
            groups = self._list(group_forms(acl_groups or []))
            if self._acl_is_array:
                public = f"array_length({self.f.acl}) == 0"
                member = f"array_contains_any({self.f.acl}, {groups})"
            else:
                public, member = f'{self.f.acl} == ""', f"{self.f.acl} in {groups}"
            parts.append(f"({public} or {member})" if acl_groups else public)
        excluded = self._ids(exclude) if exclude else "[]"
        if excluded != "[]":
            parts.append(f"{self.f.id} not in {excluded}")
        return " and ".join(parts)

    def _hit(self, entity: dict, score: float, rank: int, source: str) -> Hit:
        doc_id = str(entity[self.f.id])
        return Hit(doc_id + CHUNK_SUFFIX, doc_id, score, rank, source,
                   text=str(entity.get(self.f.text, "")), title=str(entity.get(self.f.title, "")))

    @_peer_checked
    @settled
    def search(self, vector, k: int, exclude_ids: Sequence[str] = (),
               acl_groups: Sequence[str] | None = None) -> list[Hit]:
        """As `MilvusStore.search`: exclusions are dropped here from the top
        `k + len(exclude_ids)` (a `not in` filter is evaluated row by row), past `MAX_K` in
        the filter. The ACL filter is the collection's own field: give an array field an
        INVERTED index so that Milvus need not read it row by row."""
        exclude = {doc_of(c) for c in exclude_ids}
        limit = k + len(exclude)
        filtered = sorted(exclude) if exclude and limit > MAX_K else ()
        if filtered:
            limit, exclude = k, set()
        result = self._request(
            "search", self._client.search, self.collection, data=[list(map(float, vector))],
            limit=limit, anns_field=self.f.vector, filter=self._filters(filtered, acl_groups),
            output_fields=self._outputs)
        rows = [r["entity"] | {self.f.id: r["entity"].get(self.f.id, r["id"])}
                for r in result[0]]
        sign = -1.0 if self._nearer_is_lower else 1.0  # a score is higher for a nearer row
        kept = [(row, sign * float(r["distance"])) for row, r in zip(rows, result[0])
                if str(row[self.f.id]) not in exclude][:k]
        return [self._hit(row, distance, rank, "dense")
                for rank, (row, distance) in enumerate(kept, start=1)]

    def get(self, doc_ids: Sequence[str]) -> dict[str, dict]:
        """doc id -> {doc_id, title, text, acl} (no ACL filter; see ExternalElastic.get)."""
        ids = self._ids(doc_ids)
        if ids == "[]":  # none can be an id of this collection
            return {}
        rows = self._request("query", self._client.query, self.collection,
                             output_fields=self._outputs, filter=f"{self.f.id} in {ids}")
        return {str(r[self.f.id]): _record(str(r[self.f.id]), r, self.f,
                                           blank_is_none=not self._acl_is_array) for r in rows}

    def write(self, *args, **kwargs):
        _read_only(self.spec.name)

    def count(self) -> int:
        stats = self._request("count", self._client.get_collection_stats, self.collection)
        return int(stats.get("row_count", 0))

    def _request(self, what: str, call, *args, **kwargs):
        return milvus_call(self.uri, what, call, *args, timeout_s=self.timeout_s,
                           lite=self._lite, **kwargs)

    def _list(self, values: Sequence[str]) -> str:
        return milvus_list(values, lite=not is_server(self.uri))

    def _ids(self, doc_ids: Sequence[str]) -> str:
        """Document ids as a filter list on the id field: an integer field's as numbers (a
        string never equals one; Milvus fails the query), leaving out what is no integer."""
        if not self._id_is_int:
            return self._list(list(doc_ids))
        return "[" + ", ".join(str(int(d)) for d in doc_ids if _INT64.fullmatch(d) and
                               -2**63 <= int(d) < 2**63) + "]"

    def close(self) -> None:
        """Close the client; for a Milvus Lite file, also stop its server so another process
        can open the file (one process per file). Closing twice releases once."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._client.close()
        if not served_uri(self.uri):
            release_lite(self.uri)


# --- reading: the docstore's read methods, answered by the backend --------------------------------


def _record(doc_id: str, source: dict, f: FieldMap, *, blank_is_none: bool = False) -> dict:
    """A document's record with its groups read by the rule its backend's search filters by
    (module docstring): a null is no group, any string is one, "" included (a group no caller
    holds). `blank_is_none`: a Milvus VARCHAR field, where "" is how a row says it has none."""
    acl = _value(source, f.acl)
    if acl is None or blank_is_none and acl == "":
        acl = []
    # a null in the array is no group (the backend indexes none for it); a number is its text
    groups = [str(g) for g in ([acl] if isinstance(acl, (str, int, float)) else acl)
              if g is not None and not isinstance(g, (dict, list))]
    return {"doc_id": doc_id, "title": str(_value(source, f.title, "")),
            "text": str(_value(source, f.text, "")), "acl": groups}


class ExternalDocs:
    """What the retriever asks a docstore, answered from the external backend (the lexical side
    when there is one, else the dense side). Every document is one chunk; like the owned
    docstore it returns records with their `acl`, and the retriever decides who sees them."""

    def __init__(self, source, peer=None, owns: Sequence = ()):
        """`peer`: the index's other side, whose groups count too (`stricter`); `owns`: the
        stores only this object uses, closed with it."""
        self.source, self.peer, self.owns = source, peer, tuple(owns)

    def _get(self, doc_ids: Sequence[str]) -> dict[str, dict]:
        """The records of `doc_ids`, each with the stricter of its two stores' groups."""
        docs = self.source.get(doc_ids)
        if self.peer is None or not docs:
            return docs
        others = self.peer.get(list(docs))
        return {d: rec | {"acl": stricter(rec["acl"], others[d]["acl"])} if d in others else rec
                for d, rec in docs.items()}

    def get_chunks(self, chunk_ids: Sequence[str]) -> dict[str, dict]:
        docs = self._get([doc_of(c) for c in dict.fromkeys(chunk_ids)])
        return {d["doc_id"] + CHUNK_SUFFIX: {"chunk_id": d["doc_id"] + CHUNK_SUFFIX, "n": 0, **d}
                for d in docs.values()}

    def get_document(self, doc_id: str) -> dict | None:
        found = self.read_document(doc_id)
        return None if found is None else found[0]

    def read_document(self, doc_id: str) -> tuple[dict, list[dict]] | None:
        """The document and its one chunk, from one record (`DocStore.read_document`): its
        groups and its text are one version of it."""
        doc = self._get([doc_id]).get(doc_id)
        if doc is None:
            return None
        return ({"doc_id": doc_id, "title": doc["title"], "acl": doc["acl"], "n_chunks": 1,
                 "chunk_ids": [doc_id + CHUNK_SUFFIX]},
                [{"chunk_id": doc_id + CHUNK_SUFFIX, "n": 0, "text": doc["text"]}])

    def doc_count(self) -> int:
        return self.source.count()

    def named(self, name: str, limit: int = 20, exclude: Sequence[str] = (),
              groups: Sequence[str] | None = None) -> list[dict]:
        """No title lookup on a foreign index (its title field has no exact-match contract):
        a `named` search is then the plain search."""
        return []

    def replace_documents(self, *args, **kwargs):
        _read_only(self.source.spec.name)

    def close(self) -> None:
        for store in self.owns:  # the others are closed as the retriever's stores
            store.close()


def open_external(spec: ExternalIndex, settings, *, need_dense: bool = True, embedder=None):
    """(docs, lexical, dense, embedder) for an external index, in the shape `open_stores`
    returns for an owned one. A side the index lacks is None; using it is one clear error."""
    if spec.problem:
        raise SettingsError(spec.problem)
    lexical = dense = None
    if spec.lexical == "elasticsearch":
        lexical = ExternalElastic(spec, spec.es_url or settings.es_url,
                                  api_key=settings.es_api_key or None,
                                  max_pattern=settings.grep_max_pattern,
                                  timeout_s=settings.backend_timeout_s)
    milvus = {"token": settings.milvus_token, "timeout_s": settings.backend_timeout_s,
              "logs": lite_log_dir(settings.home)}
    uri = spec.milvus_uri or settings.milvus_uri
    if spec.dense == "milvus" and is_server(uri):  # refused: said before the model loads
        try:
            server_answers(uri, settings.backend_timeout_s)
        except BackendUnavailable:
            if lexical is not None:
                lexical.close()
            raise
    if spec.dense == "milvus" and (need_dense or lexical is None):
        if embedder is None:  # also for reading only: the dimension check needs it
            from branchsearch.infra.models.embedder import Embedder

            embedder = Embedder(settings.embed_model, settings.embed_batch, settings.embed_device,
                                cache_path=Path(settings.home) / "cache" / "embeddings.sqlite")
    if spec.dense == "milvus":  # for a bm25 search too: the collection is asked for groups
        dim = embedder.dim if embedder is not None else None
        try:
            dense = ExternalMilvus(spec, uri, dim, **milvus)
        except BaseException:
            if lexical is not None:
                lexical.close()
            raise
    if dense is None:
        embedder = None
    if lexical is not None and dense is not None:  # two sides: each checks the other's groups
        lexical.peer, dense.peer = dense, lexical
    owns = () if need_dense or dense is None else (dense,)
    docs = ExternalDocs(lexical or dense, peer=dense if lexical else None, owns=owns)
    if not need_dense:
        dense, embedder = None, None
    return docs, lexical or MissingLexical(spec), dense, embedder


class MissingLexical:
    """The lexical side of a dense-only external index: every call is one clear error."""

    def __init__(self, spec: ExternalIndex):
        self.spec = spec

    def _missing(self, tool: str):
        raise BadQuery(f"{tool} needs a lexical backend; index {self.spec.name!r} has none "
                       "(use mode dense)")

    def search(self, *args, **kwargs):
        self._missing("bm25 search")

    def grep(self, *args, **kwargs):
        self._missing("grep")

    def write(self, *args, **kwargs):
        _read_only(self.spec.name)

    def count(self) -> int:
        return 0

    def close(self) -> None:
        pass
