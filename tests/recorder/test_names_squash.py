"""squash_name with anchored patterns and collision handling; target matching on segment boundaries."""

from __future__ import annotations

from trainrec.recorder.names import module_matches, param_matches, squash, squash_all


def test_squash_rules_are_anchored_on_segments():
    assert squash("encoder.layers.0.self_attn") == "0.self_attn"
    assert squash("language_model.encoder.layers.10.mlp.weight") == "10.mlp.weight"
    assert squash("model.embedding.word_embeddings.weight") == "word_embeddings.weight"
    assert squash("output_layer.weight") == "output_layer.weight"  # the reference gives "weight"
    assert squash("transformer.final_layernorm.bias") == "final_layernorm.bias"
    assert squash("decoder.norm.weight") == "norm.weight"
    assert squash("player.weight") == "player.weight"  # "layer" inside a segment is not a match
    assert squash("encoder.layers") == "encoder.layers"
    assert squash("") == ""


def test_collisions_fall_back_to_full_names_for_modules_and_params():
    names = ["vision.layers.0.attn", "text.layers.0.attn", "text.layers.1.attn", "head"]
    out = squash_all(names)
    assert out == {"vision.layers.0.attn": "vision.layers.0.attn", "text.layers.0.attn": "text.layers.0.attn",
                   "text.layers.1.attn": "1.attn", "head": "head"}
    assert len(set(out.values())) == len(out)
    # a squashed name equal to another module's full name also collides
    out2 = squash_all(["layers.0", "x.layers.0", "0"])
    assert len(set(out2.values())) == 3
    assert squash_all(names, enabled=False) == {n: n for n in names}


def test_target_matching_respects_segment_boundaries():
    assert param_matches("layers.1", "layers.1.weight", "1.weight", 0)
    assert not param_matches("layers.1", "layers.10.weight", "10.weight", 0)
    assert param_matches("0:1", "layers.1.weight", "1.weight", 0)
    assert not param_matches("1:1", "layers.1.weight", "1.weight", 0)
    assert param_matches("", "anything", "anything", 3)
    assert module_matches("layers.1", "layers.1", "1", 0)
    assert module_matches("0:1", "layers.1", "1", 0)
    assert not module_matches("layers.1", "layers.10", "10", 0)
    assert not module_matches("layers", "layers.1", "1", 0)
