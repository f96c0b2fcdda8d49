import pytest
import torch
from torch import nn

from lightning_pipe.partition import find_sequential, parameter_costs, resolve_balance, stage_bounds, stage_layers
from lightning_pipe.runtime.stage import StageModule


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(2, 2))
        self.b = nn.Sequential(nn.Linear(2, 2))


def test_finds_the_only_sequential() -> None:
    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(2, 2)
            self.layers = nn.Sequential(nn.Linear(2, 2))

    name, seq = find_sequential(One())
    assert name == "layers" and isinstance(seq, nn.Sequential)


def test_several_sequentials_need_a_name() -> None:
    with pytest.raises(ValueError, match=r"several top-level nn.Sequential attributes \('a', 'b'\).*module=\.\.\."):
        find_sequential(Two())
    assert find_sequential(Two(), "b")[0] == "b"


def test_no_sequential_explains_what_to_do() -> None:
    with pytest.raises(ValueError, match="has no top-level nn.Sequential"):
        find_sequential(nn.Linear(2, 2))


def test_no_sequential_names_the_models_own_block_containers() -> None:
    """A model of its own without an nn.Sequential: the error names its ModuleLists by their paths (the outermost
    holding blocks, not a block's own lists) as what module= can name, and no Hugging Face path."""
    from tests.models import CharGPT

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = CharGPT()
            self.adapters = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)])

    with pytest.raises(ValueError, match="has no top-level nn.Sequential") as raised:
        find_sequential(Wrapper())
    message = str(raised.value)
    assert "'gpt.blocks' (ModuleList of 4 CharBlock), 'adapters' (ModuleList of 3 Linear)" in message
    assert "module='gpt.blocks'" in message and "transformer.h" not in message and "mlp" not in message


def test_named_attribute_errors() -> None:
    with pytest.raises(ValueError, match="has no attribute 'c'. Its submodules: a, b"):
        find_sequential(Two(), "c")
    m = Two()
    m.c = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="is a Linear, not an nn.Sequential"):
        find_sequential(m, "c")


def test_stage_keeps_original_names_and_runs_like_the_slice() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    balance = resolve_balance("uniform", seq, 2)
    assert balance == [3, 2] and stage_bounds(balance) == [(0, 3), (3, 5)]
    stage = StageModule(stage_layers(seq, balance, 1), stage=1, num_stages=2)
    assert [n for n, _ in stage.named_parameters()] == ["3.weight", "3.bias", "4.weight", "4.bias"]
    x = torch.randn(2, 4)
    assert torch.equal(stage.run_layers(x, recompute=False), seq[4](seq[3](x)))


def test_balance_by_parameters() -> None:
    seq = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1), nn.Linear(1, 1))
    assert parameter_costs(seq) == [110.0, 0.0, 11.0, 2.0]
    assert resolve_balance("parameters", seq, 2) == [2, 2]  # ties go to shorter later stages


def test_resolve_balance_errors() -> None:
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Unknown balance 'speed'"):
        resolve_balance("speed", seq, 2)
    with pytest.raises(ValueError, match="balance='time' needs a measured profile"):
        resolve_balance("time", seq, 2)
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        resolve_balance([1, 1, 0], seq, 3)
    with pytest.raises(ValueError, match="sums to 3"):
        resolve_balance([1, 2], seq, 2)


def test_parameters_balance_counts_the_ends_on_the_end_stages() -> None:
    """Six equal blocks and an embedding as large as five of them held by the first stage: the first
    stage takes fewer blocks."""
    from lightning_pipe.partition.stages.split import resolve_balance

    blocks = nn.ModuleList([nn.Linear(10, 10) for _ in range(6)])
    assert resolve_balance("parameters", blocks, 2) == [3, 3]
    assert resolve_balance("parameters", blocks, 2, end_costs=(550.0, 0.0)) == [1, 5]
    assert resolve_balance("parameters", blocks, 2, end_costs=(550.0, 550.0)) == [3, 3]


def test_a_parameter_of_another_stages_layer_under_a_second_name_is_released_and_a_local_one_kept() -> None:
    """BERT's head: ``predictions.bias`` is the decoder's bias. Where the decoder is another stage's,
    the second name goes too (by identity, not by name); where it is this stage's, both stay."""
    from lightning_pipe.partition import release_foreign_parameters

    def model() -> tuple[nn.Module, nn.ModuleList]:
        root = nn.Module()
        root.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 3)])
        root.head = nn.Module()
        root.head.bias = root.layers[1].bias
        root.scale = nn.Parameter(torch.ones(1))  # outside every layer: stays everywhere
        return root, root.layers

    first, layers = model()
    assert release_foreign_parameters(first, layers, [0]) == ["head.bias"]
    assert "head.bias" not in dict(first.named_parameters()) and "scale" in dict(first.named_parameters())
    assert "layers.1.bias" in dict(first.named_parameters())  # the layer itself goes with release_elsewhere
    last, layers = model()
    assert release_foreign_parameters(last, layers, [1]) == []
    assert last.head.bias is layers[1].bias
