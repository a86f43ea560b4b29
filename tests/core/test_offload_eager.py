"""Property test of the eager store policy: its one-group loop picks what the general loop picks."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.core.block_pool import BlockPool
from kvflow.core.hashing import BlockHash, BlockHasher, HashChain
from kvflow.core.offload.config import Geometry, GroupSpec, OffloadManagerConfig
from kvflow.core.offload.eager import EagerStore
from kvflow.core.offload.state import RequestState, StoreBatch
from kvflow.core.requests import KVRequest

BS = 4
NULL = 0


def _hash(i: int) -> BlockHash:
    return i.to_bytes(16, "little")


_request = st.tuples(
    st.lists(st.integers(0, 6), min_size=0, max_size=8),  # GPU block ids (0: the null block)
    st.lists(st.integers(0, 5), min_size=8, max_size=8),  # engine hashes (few: duplicates)
    st.integers(0, 8 * BS),  # confirmed tokens
    st.integers(0, 8),  # the store cursor before the call
    st.booleans(),  # hashed by kvflow itself (else by the engine)
)


def _states(specs: list[tuple[Any, ...]]) -> list[RequestState]:
    out = []
    for n, (ids, hashes, confirmed, cursor, own) in enumerate(specs):
        tokens = list(range(n * 1000, n * 1000 + 8 * BS))
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
    pool = BlockPool(16, name="cpu")
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
