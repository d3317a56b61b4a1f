"""torchrun jobs: capture-time rank coordination (`coord`), DDP's gradient reduction observed
through its comm hook (`ddp`), the replay launcher (`launcher`), one rank's replay (`worker`,
run as ``python -m nanbisect.multirank.worker``) and the decisions all ranks share (`verdict`)."""
