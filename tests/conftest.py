import torch

# Tests are small; two threads match the CI machine and keep runs comparable.
torch.set_num_threads(2)
