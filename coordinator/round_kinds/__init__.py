"""The kinds of round the coordinator runs, one module each: every module of this folder
is imported by `coordinator.round_kind.round_kinds` and registers its `RoundKind` when
imported. A new kind (a release the coordinator schedules itself, say) is one file
here; the round engine asks the kinds rather than naming them."""
