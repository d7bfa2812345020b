"""Training: the corpus and its tokenizer (`data`), the target's own continuations (`continuations`), and
optax training of models, distilled drafts and drafter heads (`train`). Apart from the decoding package:
`import jspec` and decoding never load optax or orbax's training machinery. The losses drafters are trained
with live beside them (`jspec.drafters.losses`)."""
