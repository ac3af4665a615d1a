import torch

# The tests run tiny models: one thread avoids thread start-up and oversubscription costs on small CPUs, and keeps
# float results independent of the machine's core count.
torch.set_num_threads(1)
