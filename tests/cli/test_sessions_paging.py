"""``kvstore sessions list`` pages through the store (issue 42, item 5): a page of the store's list at
a time, printed before the next is read, and the output is what one list printed at once would be."""

from __future__ import annotations

import json

import kvstore.store
from kvstore.cli import main
from kvstore.cli import sessions as sessions_cmd
from store.support import new_session


def test_list_pages_through_every_session_and_prints_what_one_list_would(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    with kvstore.store.open(data) as store:
        for i in range(7):
            new_session(store, f"s{i}", owner="alice", tags=["even"] if i % 2 == 0 else [])
        new_session(store, "b0", owner="bob")
        whole = [info.to_dict() for info in store.list(owner="alice")]
        evens = [info.to_dict() for info in store.list(owner="alice", tags=["even"])]
    pages = []
    real_list = kvstore.store.SessionStore.list

    def counted(self, **kw):
        found = real_list(self, **kw)
        pages.append((kw.get("limit"), len(found)))
        return found

    monkeypatch.setattr(sessions_cmd, "LIST_PAGE", 3)
    monkeypatch.setattr(kvstore.store.SessionStore, "list", counted)
    assert main(["sessions", "list", "--data", str(data), "--owner", "alice", "--json"]) == 0
    out = capsys.readouterr().out
    assert out == json.dumps(whole, indent=2) + "\n"  # byte for byte what one list printed
    assert pages == [(3, 3), (3, 3), (3, 1), (3, 0)]  # never more than a page at a time
    assert main(["sessions", "list", "--data", str(data), "--owner", "alice", "--tag", "even", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == evens
    assert main(["sessions", "list", "--data", str(data), "--owner", "alice"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [f"s{i}" for i in range(7)]
    assert main(["sessions", "list", "--data", str(data), "--owner", "nobody", "--json"]) == 0
    assert capsys.readouterr().out == "[]\n"
    assert main(["sessions", "list", "--data", str(data), "--owner", "nobody"]) == 0
    assert capsys.readouterr().out == "(no sessions)\n"
