"""The environment loop with the real engine sampling: exact engine tokens, template deltas, per-turn rewards."""

import re

import pytest
from agent_helpers import encode, run, teacher_forced_logprobs

from megarl.agent import ENVIRONMENTS, AgentConfig, AgentContext, AgentSample, EngineLLM, Environment, run_agent
from megarl.rollout import SamplingParams

GAME = [{"role": "user", "content": "Guess my number (1-9)."}]


def game_context(tok, **config):
    digits = tuple(tok.convert_tokens_to_ids(list("0123456789")))
    # a random model rarely says <|im_end|>: a digit also ends its turn (the game reads the number)
    params = SamplingParams(temperature=1.0, max_tokens=30, stop_token_ids=(tok.eos_token_id,) + digits)
    base = dict(max_response_tokens=400, max_assistant_turns=4, max_user_turns=3)
    return AgentContext(tok, params, AgentConfig(**{**base, **config}))


def game_sample(tok, seed, **extra):
    prompt = encode(tok, tok.apply_chat_template(GAME, add_generation_prompt=True, tokenize=False))
    return AgentSample(
        messages=GAME,
        prompt_ids=prompt,
        ground_truth="5",
        agent_name="env",
        seed=seed,
        extra_info={"env": {"low": 1, "high": 9}},
        **extra,
    )


def expected_answer(text):
    numbers = re.findall(r"-?\d+", text)
    if not numbers:
        return "Answer with one number between 1 and 9.", -0.1
    guess = int(numbers[-1])
    return ("Correct!", 1.0) if guess == 5 else ("Higher." if guess < 5 else "Lower.", 0.0)


def test_env_trajectory_is_engine_tokens_plus_template_deltas(tok, engine, hf_model):
    ctx = game_context(tok)
    traj = run(run_agent(game_sample(tok, seed=3), EngineLLM(engine), ctx))
    assert traj.num_turns >= 2 and traj.finish_reason in ("stop", "max_turns", "length")
    model_turns = [t for t in traj.turns if t.role == "assistant"]
    for k, turn in enumerate(model_turns):
        # the model's tokens are exactly what the engine generates from that prefix with turn k's seed
        params = ctx.turn_params(game_sample(tok, 3), k, ctx.config.max_response_tokens - turn.start)
        direct = run(engine.generate(traj.prompt_ids + traj.response_ids[: turn.start], params))[0]
        assert traj.response_ids[turn.start : turn.end] == direct.token_ids
        assert traj.response_logprobs[turn.start : turn.end] == direct.logprobs
        assert traj.response_mask[turn.start : turn.end] == [1] * len(direct.token_ids)
        answer, reward = expected_answer(turn.text)
        if turn.finish_reason == "stop":
            assert turn.reward == reward
    for turn in (t for t in traj.turns if t.role == "user"):
        before = traj.response_ids[turn.start - 1]
        glue = "" if before == tok.eos_token_id else "<|im_end|>"
        answer = expected_answer(traj.turns[traj.turns.index(turn) - 1].text)[0]
        expected = encode(tok, glue + "\n<|im_start|>user\n" + answer + "<|im_end|>\n<|im_start|>assistant\n")
        assert traj.response_ids[turn.start : turn.end] == expected
        assert traj.response_mask[turn.start : turn.end] == [0] * len(expected)
    assert traj.turn_rewards() == [(t.end - 1, t.reward) for t in model_turns if t.reward is not None]
    assert traj.reward_extras["env_return"] == pytest.approx(sum(t.reward or 0.0 for t in model_turns))
    forced = teacher_forced_logprobs(hf_model, traj.prompt_ids + traj.response_ids)[len(traj.prompt_ids) - 1 :]
    for mask, logprob, ref in zip(traj.response_mask, traj.response_logprobs, forced):
        assert logprob == pytest.approx(ref, abs=1e-4) if mask else logprob == 0.0


class Scripted(Environment):
    """Answers "again" (reward 0.5), then raises on the turn given by `fail_at`, or ends after `done_at`."""

    def __init__(self, sample, *, fail_at=99, done_at=99):
        super().__init__(sample)
        self.turn, self.fail_at, self.done_at = 0, fail_at, done_at

    async def step(self, messages):
        self.turn += 1
        if self.turn == self.fail_at:
            raise RuntimeError("simulator crashed")
        return "again", 0.5, self.turn == self.done_at


ENVIRONMENTS.register("test_scripted")(Scripted)


@pytest.mark.parametrize(
    "env, config, reason, turns",
    [
        ({"fail_at": 2}, {}, "error", 2),
        ({"done_at": 2}, {}, "stop", 2),
        ({}, {"max_user_turns": 0}, "max_turns", 1),
        ({}, {"max_assistant_turns": 3, "max_user_turns": 9}, "max_turns", 3),
    ],
)
def test_env_outcomes_and_limits(tok, engine, env, config, reason, turns):
    ctx = game_context(tok, environment="test_scripted", environment_kwargs=env, **config)
    sample = game_sample(tok, seed=1)
    sample.extra_info = {}
    traj = run(run_agent(sample, EngineLLM(engine), ctx))
    if traj.finish_reason == "length":
        pytest.skip("the sampled turn ran out of max_tokens before the environment could answer")
    assert (traj.finish_reason, traj.num_turns) == (reason, turns)
    assert ("simulator crashed" in traj.error) if reason == "error" else traj.error is None
    assert traj.response_mask[-1] == 1


def test_environment_errors_name_the_fix(tok, engine):
    ctx = game_context(tok, environment_kwargs={"colour": "red"})
    with pytest.raises(ValueError, match="cannot build environment 'guess_number'.*colour"):
        run(run_agent(game_sample(tok, seed=1), EngineLLM(engine), ctx))
    sample = game_sample(tok, seed=1)
    sample.extra_info = {"environment": "chess"}
    with pytest.raises(ValueError, match="unknown environment 'chess'.*guess_number"):
        run(run_agent(sample, EngineLLM(engine), game_context(tok)))
