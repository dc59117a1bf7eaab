"""Quality against speed: `parse-vllm eval`.

tasks   -- prompt sets: MT-Bench's questions, a checkable task set made here from a seed
           (short answers with exact checks), the user's own JSONL;
checks  -- answer checkers (exact/contained answer, last number, list, code run with its
           asserts in an isolated subprocess);
metrics -- repeated 3-grams, ROUGE-L, the target's negative log-likelihood per output token;
run     -- the engines (target alone, token-level speculation, PARSE over a τ sweep, each
           timed --repeats times interleaved; the target's NLL pass), resumption, the
           command line;
timing  -- the schedule, time per task, bootstrap intervals, the noise floor;
report  -- JSON, Markdown, the speed-against-quality PNG and the recommendation.

The pure parts (tasks, checks, metrics, timing, report) do not import vLLM.
"""
