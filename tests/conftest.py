import torch

# The CPU backends run tiny shapes: one intra-op thread is as fast and does not oversubscribe a
# 2-core machine. The contract does not depend on it (engine and trainer share the process).
torch.set_num_threads(1)
