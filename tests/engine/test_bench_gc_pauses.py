"""bench/gc_pauses.py's bookkeeping: a collection is filed under its section, and counted in a window's timed
steps only between the window's two device syncs."""
from bench.gc_pauses import Pauses


def test_collections_between_a_windows_syncs_count_as_timed():
    pauses, synced = Pauses(), []
    sync = pauses.sync(synced.append)

    def collect(generation):
        pauses("start", {"generation": generation})
        pauses("stop", {"generation": generation})

    with pauses.timing("generate"):
        sync("cuda")  # a generate's syncs open no timed steps
        collect(2)
        sync("cuda")
    with pauses.timing("window 1"):
        collect(2)     # the window's prefill
        sync("cuda")
        collect(0)
        collect(2)     # in the timed steps
        sync("cuda")
        collect(2)     # the steps after them
    collect(2)         # outside any section: not filed
    generate, window = pauses.sections
    assert synced == ["cuda"] * 4
    assert [timed for _, _, timed in generate["collections"]] == [False]
    assert [(g, timed) for g, _, timed in window["collections"]] == [(2, False), (0, True), (2, True), (2, False)]
