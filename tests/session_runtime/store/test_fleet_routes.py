"""Who serves a conversation in a fleet (session_runtime/store/fleet.py), on a real
PostgreSQL server: a live owner keeps it, an orphan goes to its first choice
(or to the member a request was relayed to), a claim happens once, and the
store refuses a write from a member that does not own the conversation."""

from __future__ import annotations

import time

import pytest

from session_runtime.store.fleet import Fleet
from session_runtime.store.pg import NotOwner, PgStore
from tests.session_runtime.store.test_store import _conv


@pytest.fixture
def fleet(pg_url):
    store = PgStore(pg_url)  # the tables
    a, b = Fleet(pg_url, "http://a", ttl=1.0, member="a"), Fleet(pg_url, "http://b", ttl=1.0, member="b")
    a._beat()  # each sees the other (no beat threads here: the tests beat by hand)
    yield store, a, b
    for f in (a, b):
        f.close()
    store.close()


def _owned(store: PgStore, cid: str, owner) -> None:
    store.save(_conv(cid))
    store._sql("UPDATE conv SET owner = ? WHERE id = ?", (owner, cid))


def test_a_live_owner_keeps_its_conversation(fleet):
    store, a, b = fleet
    _owned(store, "c1", "a")
    assert a.route("c1").url is None and not a.route("c1").claimed
    assert b.route("c1").url == "http://a"
    assert b.route("c1", relayed=True).url == "http://a"  # relayed to b meanwhile: refused there, never twice


def test_an_orphan_goes_to_its_first_choice_once(fleet):
    store, a, b = fleet
    store._sql("INSERT INTO members(id, url, beat) VALUES('dead', 'http://dead', 0)")
    cids = [f"o{i}" for i in range(8)]
    for cid in cids:
        _owned(store, cid, "dead")
    for cid in cids:
        assert a.first_choice(cid) == b.first_choice(cid)  # the same view: the same choice
        first, other = (a, b) if a.first_choice(cid) == "a" else (b, a)
        assert other.route(cid).url == first.advertise  # relays to the first choice
        got = first.route(cid)
        assert got.url is None and got.claimed  # which takes it over
        assert not first.route(cid).claimed  # once
    rows = dict(store._sql("SELECT id, owner FROM conv").fetchall())
    assert {rows[c] for c in cids} == {"a", "b"}  # both took some


def test_a_request_relayed_to_a_member_lets_it_take_an_orphan_over(fleet):
    store, a, b = fleet
    store._sql("INSERT INTO members(id, url, beat) VALUES('dead', 'http://dead', 0)")
    cid = next(f"r{i}" for i in range(100) if a.first_choice(f"r{i}") == "a")
    _owned(store, cid, "dead")
    got = b.route(cid, relayed=True)  # a third member thought b its first choice
    assert got.url is None and got.claimed
    assert a.route(cid).url == "http://b"


def test_a_write_from_a_member_that_does_not_own_the_conversation_is_refused(fleet, pg_url):
    store, a, b = fleet
    _owned(store, "w", "a")
    writer = PgStore(pg_url)
    writer.member = "b"
    conv, _ = writer.load("w")
    conv.system = "changed"
    with pytest.raises(NotOwner):
        writer.save(conv)
    with pytest.raises(NotOwner):
        writer.delete("w")
    assert store.load("w")[0].system == "Be terse."  # nothing of it written
    writer.member = "a"
    writer.save(conv)
    assert store.load("w")[0].system == "changed"
    writer.close()


def test_a_member_that_stops_beating_is_gone(fleet):
    store, a, b = fleet
    assert set(a.live()) == {"a", "b"}
    time.sleep(1.2)  # b's beat lapses (ttl 1 s); a beats
    a._beat()
    assert set(a.live()) == {"a"}


def test_takeovers_go_to_the_member_under_its_bound(fleet):
    """Bounded loads (placement.py): a member holding more than (1 + epsilon)
    times the mean is nobody's first choice; the orphans go to the other."""
    store, a, b = fleet
    store._sql("INSERT INTO members(id, url, beat) VALUES('dead', 'http://dead', 0)")
    for i in range(10):
        _owned(store, f"held{i}", "a")
    orphans = [f"orphan{i}" for i in range(4)]
    for cid in orphans:
        _owned(store, cid, "dead")
    a._beat()
    b._beat()
    assert a._loads == b._loads == {"a": 10, "b": 0}
    assert {a.first_choice(c) for c in orphans} == {b.first_choice(c) for c in orphans} == {"b"}


def test_a_member_routes_its_own_without_the_store_until_its_beat_lapses(fleet):
    store, a, b = fleet
    _owned(store, "m1", "a")
    assert a.route("m1").url is None  # asked the store: a owns it
    queries: list[str] = []
    real = a._sql
    a._sql = lambda query, params=(): queries.append(query) or real(query, params)
    assert a.route("m1").url is None and queries == []  # known: not asked again
    a._beaten -= a.ttl  # a's beats lapsed, and b took the conversation over meanwhile
    store._sql("UPDATE conv SET owner = 'b' WHERE id = 'm1'")
    assert a.route("m1").url == "http://b" and queries  # asked again: relayed to its owner
    a._beat()
    _owned(store, "m2", "a")
    assert a.route("m2").url is None
    a.forget("m2")  # deleted here
    queries.clear()
    a.route("m2")
    assert queries  # no longer known: asked


def test_an_owner_that_refused_a_relay_is_taken_over_at_once_and_beats_back_in(fleet):
    """A refused connection means nothing listens at the owner's address: its
    conversations are taken over at their next request, before its beat's TTL
    has lapsed; an owner alive after all is a member again at its next beat."""
    store, a, b = fleet
    b._beat()
    _owned(store, "c2", "a")
    assert b.route("c2").url == "http://a"  # a's beat has not lapsed
    b.unreachable("a")
    assert set(b.live()) == {"b"}
    route = b.route("c2")
    assert route.url is None and route.claimed  # b takes it over now
    a._beat()  # a was alive after all: it beats back in and the conversation stays b's
    b._beat()
    assert set(b.live()) == {"a", "b"} and a.route("c2").url == "http://b"
    b.unreachable("b")  # never itself
    assert "b" in b.live()
