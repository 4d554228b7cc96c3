"""English text the built-in tokenizer learns its first merges from (written for this project).

It only has to be fixed and varied enough that the merges look like real subwords.
"""

TRAINING_TEXT = """\
A language model server spends its life in two very different moods. During prefill it
reads the whole prompt at once: thousands of tokens flow through every layer in a single
pass, the matrix multiplications are large, and the accelerator is busy doing arithmetic.
During decode it produces one token per request per step, reading the entire key and value
cache for every new token, so the work is small and the memory traffic is large. Putting
both moods on the same machine means that a long prompt arriving in the middle of a busy
decode batch stalls every other request, and the time between tokens jumps for everyone.

Disaggregated serving separates the two. A pool of prefill workers computes the prompt and
fills the key and value cache; a pool of decode workers receives that cache and continues
the generation token by token. The router decides which prefill worker takes a request and
which decode worker will finish it, and the transfer layer moves the cached pages between
them over the fastest link it can find. When the transfer is quick, the time to first
token stays low and the inter-token latency stays smooth, even under heavy load.

The cache itself is stored in pages. Each page holds the keys and values of a fixed number
of tokens for every layer, and a block table maps the positions of a sequence to the pages
that hold them. Pages are handed out by a pool and returned when a request finishes. When
two requests share the same beginning, for example the same system prompt, the pool can
recognise the shared pages by a hash of their tokens and reuse them instead of computing
them again. This prefix caching saves both compute and memory, and it matters most for
chat applications where every conversation starts with the same instructions.

A scheduler looks at the waiting and running requests before every step. It chooses how
many prompt tokens to prefill, how many sequences to decode, and whether memory is tight
enough that some request must be preempted and its pages released. Good schedulers keep
the batch full without letting any single request starve. They measure throughput in
tokens per second, time to first token, and the latency between tokens, and they report
these numbers so that operators can see when the cluster needs more replicas.

Sampling turns the final logits into the next token. Greedy decoding takes the most likely
token; temperature, top-k and top-p sampling trade a little likelihood for variety. The
tokenizer then turns token ids back into text, carefully, because a single id may hold only
part of a character: an accented letter such as é, a dash like —, or a character such as
你 or 好 may need several bytes, and an emoji needs four. Detokenizing incrementally means
holding back those partial bytes until the character is complete.

Testing a serving system is easier with small models whose weights are fixed by a seed.
The same seed always gives the same checkpoint, so a test can compare the tokens produced
by the engine with the tokens produced by a reference implementation and expect them to
match exactly. Small models also make it cheap to check that no pages leak, that a request
cancelled in the middle releases its memory, and that the status codes returned by the
server are the ones a user would expect.
"""
