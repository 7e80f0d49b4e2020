"""Who sees a document: the one ACL rule every backend and the service apply.

A document without an ACL is public (group `PUBLIC`); a caller sees a restricted document when
they share a group; `ACL_ALL` in a caller's groups (the explicit admin setting) sees everything.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

from branchsearch.infra.errors import BadQuery


PUBLIC = "__public__"  # the ACL group of documents without an ACL
ACL_ALL = "*"  # in a caller's groups: sees every document (the explicit admin setting)


def group_name(name: str) -> str:
    """A group name as it is stored and compared: stripped and in Unicode NFC, so `café` typed
    on macOS (NFD: `e` + a combining accent) is the group `café` typed elsewhere. Look-alikes
    in other scripts (a Cyrillic `с`) stay other groups."""
    return unicodedata.normalize("NFC", name.strip())


def group_forms(groups: Sequence[str]) -> list[str]:
    """Each group's name as given, its stored name (`group_name`) and that name's NFD form, for
    filters on stored group names: an index written before names were normalised, or a store
    written directly, may hold any of them."""
    return list(dict.fromkeys(
        f for g in groups
        for f in (g, group_name(g), unicodedata.normalize("NFD", group_name(g))) if f.strip()))


def acl_terms(groups: Sequence[str] | None) -> list[str] | None:
    """The index terms a caller may match; None means no filter at all.

    Closed by default: `None` (no groups) sees public documents only; groups add the documents
    restricted to any of them; only `ACL_ALL` among the groups (an explicit admin setting) lifts
    the filter. Every backend (tantivy, Milvus, Elasticsearch) filters on these terms.
    """
    groups = [] if groups is None else [groups] if isinstance(groups, str) else list(groups)
    if ACL_ALL in groups:
        return None
    return [PUBLIC, *group_forms([g for g in groups if g and g != PUBLIC])]


def acl_visible(doc_acl: Sequence[str], groups: Sequence[str] | None) -> bool:
    """Whether a document with ACL `doc_acl` (empty: public) is visible to a caller with `groups`
    (same rule as `acl_terms`, for reads by id)."""
    terms = acl_terms(groups)
    return terms is None or not doc_acl or bool(
        {f for g in doc_acl for f in (g, group_name(g))} & set(terms))


MAX_GROUP_CHARS = 128  # as a key's groups (`keys add --groups`)
MAX_DOC_GROUPS = 64  # groups one document may name: a Milvus server's ACL array holds no more


def group_problem(name: str) -> str:
    """Why `name` (stripped) cannot be a group a key holds ("" when it can): a document's
    group no key can hold would be seen by global admins only, silently."""
    if any(c.isspace() for c in name):
        return f"ACL group {name!r} holds a space: API keys' groups cannot, use '-' or '_'"
    if len(name) > MAX_GROUP_CHARS:
        return f"ACL group {name[:40]!r}… is longer than {MAX_GROUP_CHARS} characters"
    return ""


def caller_groups(groups: Sequence[str] | None, admin: bool = False) -> list[str] | None:
    """The `acl_groups` to pass for a caller: `[ACL_ALL]` for an admin, else its groups (None:
    public only)."""
    groups = list(groups or ())
    if any(not g.strip() for g in groups):  # `--acl "$GROUP"` with GROUP unset, most likely
        raise BadQuery("ACL group names may not be empty")
    groups = [group_name(g) for g in groups]
    comma = next((g for g in groups if "," in g), None)
    if comma is not None:  # as in a key's groups, where "a,b" is two
        raise BadQuery(f"ACL group {comma!r} holds a comma: name each group on its own "
                       "(--acl a --acl b)")
    if admin:
        return [ACL_ALL]
    if ACL_ALL in groups:
        raise BadQuery(f"ACL group {ACL_ALL!r} is reserved: seeing every document needs the "
                       "admin setting (acl_admin = true, or --acl-admin)")
    if PUBLIC in groups:
        raise BadQuery(f"ACL group {PUBLIC!r} is reserved: every caller sees the documents "
                       "without an ACL; name only the groups of restricted ones")
    return groups or None
