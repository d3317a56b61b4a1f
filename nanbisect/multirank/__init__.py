"""torchrun jobs, replayed: DDP's gradient reduction observed through its comm hook (`ddp`), the
replay launcher (`launcher`) and the process that starts the ranks (`spawn`), one rank's replay
(`worker`, run as ``python -m nanbisect.multirank.worker``), a rank replayed alone (`alone`) on
the collectives the capture recorded (`served`), the rank sides (`sides`) and the decisions all
ranks share (`verdict`). Capturing them (rank coordination, the multi-rank bundle, recording the
collectives) is `nanbisect.guard` (`guard.coord`, `guard.retape`).

The package's internal interface (what its modules share, not for other stages): the launcher
reads a hang or a death through `diagnose` (`ask_stacks`, `hang`, `died`, `rank_stage`,
`PEER_GONE`, `exit_statuses`, `where`) and ends a run through `rundir` (`kill_run`, `run_dir`,
`sweep`, `PREFIX`)."""
