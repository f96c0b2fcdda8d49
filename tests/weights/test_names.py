import pytest

from lightning_pipe.weights.names import apply_rename, check_rename, mismatch_hint, name_map

# a LightningModule holding a GPT-2 as self.model: the tied head is one tensor with two names
MODULE = [
    "model.transformer.wte.weight", "model.transformer.h.0.attn.weight", "model.transformer.h.1.attn.weight",
    "model.transformer.ln_f.weight", "model.lm_head.weight",
]  # fmt: skip
ALIASES = {n: [n] for n in MODULE}
ALIASES["model.transformer.wte.weight"] = ALIASES["model.lm_head.weight"] = [
    "model.transformer.wte.weight",
    "model.lm_head.weight",
]
SAVED = [
    "transformer.wte.weight",
    "transformer.h.0.attn.weight",
    "transformer.h.1.attn.weight",
    "transformer.ln_f.weight",
]


def test_names_that_fit_are_kept() -> None:
    names = name_map(MODULE, ALIASES)
    assert names.names == {n: n for n in MODULE} and names.prefix is None


def test_the_models_attribute_is_found_as_the_one_prefix_that_fits() -> None:
    names = name_map(SAVED, ALIASES)  # save_pretrained drops the tied lm_head.weight
    assert names.prefix == "model."
    assert names.names == {f: "model." + f for f in SAVED}
    hub = ["wte.weight", "h.0.attn.weight", "h.1.attn.weight", "ln_f.weight"]  # a base model's checkpoint
    assert name_map(hub, ALIASES).prefix == "model.transformer."


def test_a_prefix_that_reaches_part_of_the_module_is_taken_for_the_check_to_list_the_rest() -> None:
    """'model.transformer.' fits every file name of a checkpoint without the embedding, and is the only
    prefix that does: taken, so the check that follows names the module's missing tensors in module terms."""
    blocks = ["h.0.attn.weight", "h.1.attn.weight", "ln_f.weight"]
    names = name_map(blocks, ALIASES)
    assert names.prefix == "model.transformer."
    assert "model.transformer.wte.weight" not in names.names.values()
    partly = name_map(["h.0.attn.weight", "h.1.attn.weight", "gone.weight"], ALIASES)  # one name fits nowhere
    assert partly.prefix == "model.transformer." and partly.names["gone.weight"] == "model.transformer.gone.weight"


def test_several_copies_of_the_model_are_ambiguous() -> None:
    twice = [p + n for p in ("student.", "teacher.") for n in ("w", "b")]
    with pytest.raises(ValueError, match=r"several prefixes \('student.', 'teacher.'\).*rename=\{'': 'student.'\}"):
        name_map(["w", "b"], {n: [n] for n in twice})
    assert name_map(["w", "b"], {n: [n] for n in twice}, rename={"": "teacher."}).names == {
        "w": "teacher.w",
        "b": "teacher.b",
    }


def test_names_mostly_fitting_as_they_are_stay_for_the_check_to_list() -> None:
    module = {n: [n] for n in ("layers.0.weight", "layers.0.bias", "layers.2.weight")}
    names = name_map(["layers.0.weight", "layers.0.bias", "head.weight"], module)
    assert names.prefix is None and names.names["head.weight"] == "head.weight"


def test_rename_by_prefix_whole_name_and_callable() -> None:
    files = ["h.0.w", "h.1.w", "emb.w", "old.bias"]
    mapping = {"h.": "model.blocks.", "h.1.w": "model.last.w", "emb.": "model.embed.", "old.": None}
    assert apply_rename(files, mapping) == {
        "h.0.w": "model.blocks.0.w",
        "h.1.w": "model.last.w",
        "emb.w": "model.embed.w",
    }
    assert apply_rename(files, lambda n: None if n.startswith("old") else "x." + n) == {
        "h.0.w": "x.h.0.w", "h.1.w": "x.h.1.w", "emb.w": "x.emb.w",
    }  # fmt: skip
    assert apply_rename(["a", "b"], {}) == {"a": "a", "b": "b"}  # names no key matches stay


def test_bad_renames_are_refused_naming_the_problem() -> None:
    with pytest.raises(ValueError, match="maps both 'a.w' and 'b.w' to 'c.w'"):
        apply_rename(["a.w", "b.w"], {"a.": "c.", "b.": "c."})
    with pytest.raises(TypeError, match=r"rename=3: give a mapping of file-name prefixes"):
        check_rename(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"entries \[1\] are not str -> str"):
        check_rename({1: "a"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="rename gave names that are not strings: 'a' -> 3"):
        apply_rename(["a"], lambda n: 3)  # type: ignore[arg-type,return-value]


def test_the_hint_says_how_names_were_matched_and_shows_both_sides() -> None:
    hint = mismatch_hint(name_map(SAVED, ALIASES), SAVED, MODULE)
    assert (
        "prefix 'model.' added" in hint and "'transformer.h.0.attn.weight'" in hint and "'model.lm_head.weight'" in hint
    )
    assert "rename" in hint
    assert mismatch_hint(name_map(SAVED, ALIASES, rename={}), SAVED, MODULE).startswith(
        "The file's names were mapped by rename."
    )
