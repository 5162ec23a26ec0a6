"""Hugging Face TRL's GRPOTrainer generating with weightbus-fed engines (docs/trl.md).

```python
rollouts = WeightbusRollouts(publisher)
trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), rollout_func=rollouts)
```
"""

from weightbus.integrations.trl.completions import EngineCompletionError
from weightbus.integrations.trl.pushes import PushRecord
from weightbus.integrations.trl.rollouts import (
    OffPolicyRolloutsError,
    RolloutStep,
    WeightbusRollouts,
)

__all__ = [
    "EngineCompletionError",
    "OffPolicyRolloutsError",
    "PushRecord",
    "RolloutStep",
    "WeightbusRollouts",
]
