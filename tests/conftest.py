import torch

# The tests run tiny models: one thread avoids thread start-up and oversubscription costs on small CPUs, and keeps
# float results independent of the machine's core count.
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny random Llama target with the character tokenizer, as a Hugging Face folder (the training tests)."""
    from ddtree.models.testing import write_random_target
    from tests.tiny_tokenizer import make_char_tokenizer

    path = tmp_path_factory.mktemp("tiny_target")
    write_random_target(path, seed=3)
    make_char_tokenizer().save_pretrained(str(path))
    return path
