"""Large files carry per-piece sha256s, checked on every core: a changed byte in any piece is
named with its offset, in the cache (entry evicted, rebuilt) and in bundles; `bundle verify`
checks the whole-file digest too. The piece size is shrunk here so small files have pieces."""
import hashlib
import os

import pytest

from conftest import flip_byte
from precast.compiler.cache import Cache
from precast.runtime import digests, manifest_schema
from precast.runtime.digests import file_record, piece_digests, verify_file

PIECE = 4096


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(digests, "PIECE", PIECE)
    monkeypatch.setattr(manifest_schema, "PIECE", PIECE)


def test_record_has_the_whole_digest_and_one_digest_per_piece(tmp_path):
    data = os.urandom(5 * PIECE + 123)
    (tmp_path / "w.bin").write_bytes(data)
    rec = file_record(tmp_path / "w.bin")
    assert rec["size"] == len(data) and rec["sha256"] == hashlib.sha256(data).hexdigest()
    assert rec["pieces"] == [hashlib.sha256(data[i:i + PIECE]).hexdigest() for i in range(0, len(data), PIECE)]
    assert piece_digests(tmp_path / "w.bin", workers=1) == piece_digests(tmp_path / "w.bin", workers=4)
    (tmp_path / "small.bin").write_bytes(b"x" * PIECE)
    assert "pieces" not in file_record(tmp_path / "small.bin")


@pytest.mark.parametrize("offset", [0, PIECE - 1, 3 * PIECE + 7, 5 * PIECE + 100])
def test_a_changed_byte_in_any_piece_is_named(tmp_path, offset):
    (tmp_path / "w.bin").write_bytes(os.urandom(5 * PIECE + 123))
    rec = file_record(tmp_path / "w.bin")
    assert verify_file(tmp_path, "w.bin", rec) is None
    flip_byte(tmp_path / "w.bin", offset)
    problem = verify_file(tmp_path, "w.bin", rec)
    assert problem and "w.bin" in problem and f"bytes from {offset // PIECE * PIECE}" in problem


def test_whole_check_catches_pieces_that_disagree_with_the_digest(tmp_path):
    """A record whose pieces were edited to match a changed file still fails `bundle verify`."""
    (tmp_path / "w.bin").write_bytes(os.urandom(3 * PIECE))
    rec = file_record(tmp_path / "w.bin")
    flip_byte(tmp_path / "w.bin", PIECE + 5)
    forged = {**rec, "pieces": piece_digests(tmp_path / "w.bin")}
    assert verify_file(tmp_path, "w.bin", forged) is None
    assert "sha256 differs" in verify_file(tmp_path, "w.bin", forged, whole=True)


def test_cache_entry_with_a_damaged_piece_is_evicted_and_rebuilt(tmp_path):
    cache = Cache(tmp_path / "cache")
    payload = os.urandom(6 * PIECE)
    builds = []

    def build(folder):
        builds.append(folder)
        (folder / "model.bin").write_bytes(payload)
        return {"entry": "model.bin"}

    entry, hit, _ = cache.get_or_build("k" * 64, build)
    assert not hit and len(entry.files["model.bin"]["pieces"]) == 6
    flip_byte(entry.path / "model.bin", 4 * PIECE + 1)
    again, hit, evicted = cache.get_or_build("k" * 64, build)
    assert not hit and "sha256" in evicted and len(builds) == 2
    assert (again.path / "model.bin").read_bytes() == payload
