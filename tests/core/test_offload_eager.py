"""Property test of the eager store policy: its one-group loop picks what the general loop picks."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.core.hashing import BlockHash, BlockHasher, HashChain
from kvflow.core.offload.config import Geometry, GroupSpec, OffloadManagerConfig
from kvflow.core.offload.eager import EagerStore
from kvflow.core.offload.state import RequestState, StoreBatch
from kvflow.core.requests import KVRequest
from kvflow.core.run_pool import RunBlockPool

BS = 4
NULL = 0


def _hash(i: int) -> BlockHash:
    return i.to_bytes(16, "little")


_request = st.tuples(
    # GPU block ids (0: the null block; few or many: a prefill's blocks all picked at once).
    st.lists(st.integers(0, 6) | st.integers(7, 60), min_size=0, max_size=12),
    # Engine hashes: few (duplicates, cached, being stored) or many (a whole prefill picked).
    st.lists(st.integers(0, 5) | st.integers(6, 400), min_size=12, max_size=12),
    st.integers(0, 12 * BS),  # confirmed tokens
    st.integers(0, 12) | st.just(0),  # the store cursor before the call
    st.booleans(),  # hashed by kvflow itself (else by the engine)
)


def _states(specs: list[tuple[Any, ...]]) -> list[RequestState]:
    out = []
    for n, (ids, hashes, confirmed, cursor, own) in enumerate(specs):
        tokens = list(range(n * 1000, n * 1000 + 12 * BS))
        confirmed = min(confirmed, len(ids) * BS)
        hashers: list[HashChain]
        if own:
            hasher = BlockHasher(BS, ())
            hashers = [hasher]
            hash_list: list[BlockHash] = hasher.hashes
        else:
            hashers = []
            hash_list = [_hash(h) for h in hashes]
        out.append(
            RequestState(
                request=KVRequest.from_prompt(f"r{n}", tokens),
                hashers=hashers,
                hashing=tuple(hashers),
                hash_lists=(hash_list,),
                table=(list(ids),),
                cursor=[min(cursor, confirmed // BS)],
                confirmed=confirmed,
            )
        )
    return out


def _store(cached: list[int], storing: list[int]) -> EagerStore:
    config = OffloadManagerConfig(groups=(GroupSpec(block_size=BS, num_cpu_blocks=16),))
    pool = RunBlockPool(16, name="cpu")
    hashes = [_hash(h) for h in dict.fromkeys(cached)]
    ids = pool.get_new_blocks(len(hashes))
    pool.cache(ids, hashes)
    pool.free(ids)
    in_flight = [{_hash(h): 99 for h in storing}]
    return EagerStore(Geometry.of(config), [pool], in_flight, null_block_id=NULL, interval=1)


def _result(batch: StoreBatch, sts: list[RequestState]) -> tuple[Any, ...]:
    owners = [[None if o is None else o.request.request_id for o in g] for g in batch.owners]
    state = [(s.cursor, s.next_boundary, list(s.hash_lists[0])) for s in sts]
    return batch.blocks, owners, [s.request.request_id for s in batch.reqs], state


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_request, max_size=4),
    st.lists(st.integers(0, 5), max_size=4),
    st.lists(st.integers(0, 5), max_size=3),
    st.booleans(),
)
def test_one_group_collect_equals_the_general_one(
    specs: list[tuple[Any, ...]], cached: list[int], storing: list[int], pick: bool
) -> None:
    """For one KV cache group, the unrolled loop gives the same batch, cursors, boundaries and
    hashes as the loop over groups, whatever is cached, being stored or the null block."""
    one, general = _states(specs), _states(specs)
    batch_one, batch_general = StoreBatch.empty(1), StoreBatch.empty(1)
    _store(cached, storing)._collect_one(one, batch_one, pick)
    _store(cached, storing)._collect_groups(general, batch_general, pick)
    assert _result(batch_one, one) == _result(batch_general, general)


_prefill = st.tuples(
    st.lists(st.integers(1, 60), min_size=8, max_size=12, unique=True),  # no null block
    st.lists(st.integers(0, 400), min_size=12, max_size=12, unique=True),
    st.just(12 * BS),
    st.integers(0, 2),
    st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(_prefill | _request, min_size=1, max_size=3),
    st.lists(st.integers(0, 400), max_size=3),
    st.lists(st.integers(0, 400), max_size=2),
)
def test_whole_prefills_are_picked_as_the_general_loop_picks(
    specs: list[tuple[Any, ...]], cached: list[int], storing: list[int]
) -> None:
    """Requests completing many blocks at once (picked as a whole where nothing is skipped)
    give the same batch as the loop over groups, with or without a block cached, being
    stored or picked by an earlier request of the batch."""
    one, general = _states(specs), _states(specs)
    batch_one, batch_general = StoreBatch.empty(1), StoreBatch.empty(1)
    _store(cached, storing)._collect_one(one, batch_one, True)
    _store(cached, storing)._collect_groups(general, batch_general, True)
    assert _result(batch_one, one) == _result(batch_general, general)
