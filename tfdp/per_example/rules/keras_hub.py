"""KerasHub's layers on the batched path (imported only with keras_hub).

Allow-list entries are claims about each layer's `call`, read in keras-hub
0.32's source:

* TransformerEncoder / TransformerDecoder: attention with each example's own
  padding mask (merged per example) and a causal mask that is the same for
  every example, residuals, Dense feed-forward, LayerNormalization; no
  weights of their own, so their sublayers are looked into.
* CachedMultiHeadAttention: MultiHeadAttention with a per-example key/value
  cache (training passes none). Its vLLM paged-attention route runs only while
  serving on TPU.
* TokenAndPositionEmbedding: a token lookup plus a PositionEmbedding.
* PositionEmbedding: the table's rows at positions start_index + t (or
  `positions`), broadcast over the batch: a lookup, so `EmbeddingGrads`.
* ReversibleEmbedding: keras.layers.ReversibleEmbedding unchanged (tfdp's
  `reversible_embedding` rule, tied uses summed).
* RMSNormalization: x / rms(x) * scale over the last axis of one example; its
  scale takes the per-layer fallback.
* gelu_approximate (BERT's and GPT-2's activation): elementwise gelu.
* RotaryEmbedding: rotation of each position by a fixed angle, no weights.
* Gemma's decoder block, attention and RMSNormalization: the same claims
  (per-example masks, causal mask shared by all examples).
* FNetEncoder: a 2-D FFT over each example's own (sequence, feature) axes
  (`ops.fft2` transforms the last two axes), residuals, LayerNormalization,
  Dense feed-forward; no weights of its own.
* Llama's decoder block, attention, rotary embedding and LlamaLayerNorm: the
  decoder merges each example's padding mask with the causal mask shared by
  all examples, as Gemma's; the attention projects with EinsumDense,
  rotates queries and keys per position (LlamaRotaryEmbedding, no weights),
  repeats key/value heads and applies a softmax over each example's scores
  (or `ops.dot_product_attention` where a fused kernel exists); its vLLM
  route runs only while serving on TPU. LlamaLayerNorm is x / rms(x) *
  scale over the last axis of one example; its scale takes the per-layer
  fallback.
* ViT: ViTPatchingAndEmbedding (a Conv2D on each image's patches, a class
  token tiled over the batch, position rows added; its own class token sends
  it to the per-layer fallback), ViTEncoderBlock and its MLP (LayerNorm,
  MultiHeadAttention without masks, Dense), ViTEncoder (the blocks in turn).

Example:

>>> import keras_hub
>>> from tfdp.per_example.registry import is_per_example
>>> is_per_example(keras_hub.layers.TransformerEncoder(8, 2))
True
"""

import keras
import keras_hub
import tensorflow as tf

from tfdp.per_example.configuration import declare_per_example_activation
from tfdp.per_example.registry import ALLOWED, register_rule
from tfdp.per_example.rules.common import plain_weights
from tfdp.per_example.rules.embedding import EmbeddingGrads
from tfdp.per_example.rules.reversible_embedding import ReversibleEmbeddingRule

_H = keras_hub.layers


def _gemma_layers():
    from keras_hub.src.models.gemma.gemma_attention import CachedGemmaAttention
    from keras_hub.src.models.gemma.gemma_decoder_block import GemmaDecoderBlock
    from keras_hub.src.models.gemma.rms_normalization import RMSNormalization

    return [CachedGemmaAttention, GemmaDecoderBlock, RMSNormalization]


def _llama_layers():
    from keras_hub.src.models.llama.llama_attention import LlamaAttention
    from keras_hub.src.models.llama.llama_decoder import LlamaTransformerDecoder
    from keras_hub.src.models.llama.llama_layernorm import LlamaLayerNorm
    from keras_hub.src.models.llama.llama_rotary_embedding import LlamaRotaryEmbedding

    return [LlamaAttention, LlamaTransformerDecoder, LlamaLayerNorm, LlamaRotaryEmbedding]


def _vit_layers():
    from keras_hub.src.models.vit import vit_layers

    return [vit_layers.ViTPatchingAndEmbedding, vit_layers.ViTEncoderBlock, vit_layers.MLP,
            vit_layers.ViTEncoder]


ALLOWED.update([
    _H.TransformerEncoder, _H.TransformerDecoder, _H.CachedMultiHeadAttention,
    _H.TokenAndPositionEmbedding, _H.PositionEmbedding, _H.ReversibleEmbedding,
    _H.RMSNormalization, _H.RotaryEmbedding, _H.FNetEncoder, *_gemma_layers(), *_llama_layers(),
    *_vit_layers(),
])

register_rule(_H.ReversibleEmbedding)(ReversibleEmbeddingRule)

# BERT's and GPT-2's feedforward activation: keras.activations.gelu(x,
# approximate=True), elementwise (keras_hub/src/utils/keras_utils.py).
declare_per_example_activation(keras_hub.src.utils.keras_utils.gelu_approximate)
# Llama's gated feed-forward activation: keras.ops.silu, x * sigmoid(x),
# elementwise (keras_hub/src/models/llama/llama_backbone.py passes the op).
declare_per_example_activation(keras.ops.silu)


@register_rule(_H.PositionEmbedding)
class PositionEmbeddingRule:
    """PositionEmbedding as a lookup of rows at each example's positions."""

    def supports(self, layer):
        return plain_weights(layer)

    def call(self, layer, recorder, call, inputs, start_index=0, positions=None):
        inputs = tf.convert_to_tensor(inputs)
        outputs = call(inputs, start_index=start_index, positions=positions)
        shape = tf.shape(inputs)
        batch, length = shape[0], shape[-2]
        if positions is None:
            ids = tf.cast(start_index, tf.int32) + tf.range(length)
        else:
            ids = tf.cast(positions, tf.int32)
        ids = tf.broadcast_to(tf.reshape(ids, [-1, length]), tf.stack([batch, length]))
        record = recorder.record(layer, ids=ids)
        return record.probe("rows", outputs)

    def parts(self, layer, records):
        ids, grads = [], []
        for r in records:
            g = r.grads["rows"]
            rank = g.shape.rank
            if rank > 3:  # inputs [B, ..., S, D]: rows broadcast over the middle axes
                g = tf.reduce_sum(g, list(range(1, rank - 2)))
            ids.append(r.ids)
            grads.append(g)
        return [EmbeddingGrads(tf.concat(ids, 1), tf.concat(grads, 1), layer.position_embeddings)]
