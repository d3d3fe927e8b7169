import pytest

from lightning_greedysnake.lookahead import LookaheadLoader


class Source:
    """An iterable with attributes, like a DataLoader."""

    def __init__(self, n):
        self.n = n
        self.sampler = "the-sampler"
        self.iterations = 0

    def __iter__(self):
        self.iterations += 1
        return iter(range(self.n))

    def __len__(self):
        return self.n


def test_delivers_the_same_sequence_while_reading_ahead():
    loader = LookaheadLoader(Source(7), keep=4)
    it = iter(loader)
    assert next(it) == 0
    assert it.get(3) == 3 and it.get(2) == 2  # read ahead without consuming
    assert [next(it) for _ in range(6)] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(StopIteration):
        next(it)


def test_get_past_the_end_is_none_and_recent_batches_are_remembered():
    it = iter(LookaheadLoader(Source(3), keep=2))
    assert it.get(5) is None
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    assert it.get(1) == 1 and it.get(2) == 2
    with pytest.raises(IndexError):
        it.get(0)


def test_forwards_attributes_and_len_and_sets():
    source = Source(5)
    loader = LookaheadLoader(source, keep=2)
    assert len(loader) == 5 and loader.sampler == "the-sampler"
    loader.worker_init_fn = "fn"
    assert source.worker_init_fn == "fn"  # Lightning sets attributes after process_dataloader
    iter(loader), iter(loader)
    assert source.iterations == 2
