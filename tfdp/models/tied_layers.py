"""A Functional model's layer that is also a sublayer of another of its
layers keeps being one object after saving and loading.

KerasHub's causal LMs (GPT-2, Gemma, Llama) project their outputs with the
backbone's own token embedding: `DPModel(task.inputs, task.outputs)` calls
`backbone.token_embedding` at its top level as well as inside the backbone.
Keras saves the layer's weights once (under the backbone), but its
`from_config` builds the top-level layer anew, a second, untied embedding,
and loading then fails ("Layer 'token_embedding' expected 1 variables, but
received 0"). tfdp's config records each such layer with the layer that
owns it (`tied_layers`), and `retie` rebuilds the loaded graph with the
owner's sublayer in its place.

Example:

>>> import keras
>>> inner = keras.layers.Dense(4, name="inner")
>>> inputs = keras.Input((4,))
>>> block = keras.Sequential([inner], name="block")
>>> model = keras.Model(inputs, inner(block(inputs)))
>>> tied_layers(model)
{'inner': 'block'}
"""

import keras


def tied_layers(model):
    """{name: owner name} for each layer of `model` (not an input) that is also
    a sublayer of another of its layers.

    Args:
        model: a Functional model.

    Returns:
        A dict of layer names.
    """
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    owned = [
        (owner, {id(sublayer) for sublayer in owner._flatten_layers(include_self=False)})
        for owner in layers
    ]
    tied = {}
    for layer in layers:
        owner = next((o for o, sublayers in owned if id(layer) in sublayers), None)
        if owner is not None:
            tied[layer.name] = owner.name
    return tied


def retie(model, tied):
    """The outputs of `model`'s graph run again with each layer named in
    `tied` replaced by the owner's sublayer of that name.

    Args:
        model: the Functional model Keras built from the saved config.
        tied: `tied_layers` of the saved model.

    Returns:
        The new output tensors, over `model.input`.

    Raises:
        ValueError: if an owner has no sublayer of the recorded name.
    """
    by_name = {layer.name: layer for layer in model.layers}
    replaced = {}
    for name, owner_name in tied.items():
        owner = by_name[owner_name]
        found = [s for s in owner._flatten_layers(include_self=False) if s.name == name]
        if len(found) != 1:
            raise ValueError(
                f"The saved model's layer {name!r} was a sublayer of {owner_name!r}, but "
                f"{owner_name!r} built from its config has {len(found)} sublayers of that "
                "name, so the two cannot be tied again."
            )
        replaced[id(by_name[name])] = found[0]
    return model._run_through_graph(
        model.input, operation_fn=lambda operation: replaced.get(id(operation), operation)
    )
