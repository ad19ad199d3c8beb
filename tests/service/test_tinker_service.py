"""The Tinker-compatible service (polyrl/service) driven by the real ``tinker`` client over
HTTP: one service per backend (real Ray, the actor's EngineGroup, a vLLM rollout server)
on the tiny model; every test on torch_fsdp, and in the slow tier on jax_pjit too."""

from __future__ import annotations

import numpy as np
import pytest
import tinker  # (pinned in requirements/cpu.lock: missing must fail, not skip)
from tinker import types
from tinker_helpers import (
    copy_prompts,
    datum,
    forward_log_probs,
    sft_steps,
    step,
)


@pytest.fixture(
    scope="module",
    params=[
        "torch_fsdp",
        pytest.param("jax_pjit", marks=pytest.mark.slow),
        # another local HF directory: the tiny model with its embedding padded past the
        # tokenizer (64 rows, 58 tokens), where sampler and trainer must score the same ids
        pytest.param("torch_fsdp+padded", marks=pytest.mark.slow),
    ],
)
def served(request, ray_session, tmp_path_factory):
    from polyrl.data.tiny import TinyModelSpec, ensure_tiny_model
    from polyrl.service import DEFAULT_GIN, serve_in_thread, start

    run_dir = tmp_path_factory.mktemp("tinker")
    backend, _, padded = request.param.partition("+")
    params = [f"polyrl.RunConfig.run_dir = '{run_dir}'"]
    if padded:
        spec = TinyModelSpec(vocab_multiple=16, initializer_range=0.1)
        model = ensure_tiny_model(tmp_path_factory.mktemp("padded"), spec)
        params.append(f"polyrl.RunConfig.model_path = '{model}'")
    service = start([DEFAULT_GIN, f"gin/backends/{backend}.gin"], params)
    assert service.actor.backend == backend
    server, url = serve_in_thread(service)
    yield service, url
    server.should_exit = True
    service.shutdown()


@pytest.fixture(scope="module")
def client(served):
    service, url = served
    client = tinker.ServiceClient(base_url=url, api_key="tml-local")
    yield client
    # finished while the service still answers: an open session's heartbeat would go on
    # after the module and print "Tinker is down" at the end of the test run
    client.close("success").result()


@pytest.fixture(scope="module")
def trainer(served, client):
    return client.create_lora_training_client(base_model=served[0].name, rank=8).result()


def test_capabilities_and_info_name_the_served_model(served, client, trainer):
    service, _ = served
    caps = client.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [service.name]
    info = trainer.get_info()
    assert info.is_lora and info.lora_rank == 8 and info.model_data.model_name == service.name
    assert len(trainer.get_tokenizer().encode("copy 123")) > 2


def test_sft_loop_lowers_the_loss(trainer):
    tok = trainer.get_tokenizer()
    data = [datum(tok, f"copy {n} -> {n}") for n in ("123", "456", "789", "246")]
    losses = sft_steps(trainer, data, steps=4, lr=1e-2)
    assert losses[-1] < 0.5 * losses[0], losses


def test_sampler_log_probs_equal_forward_log_probs(served, trainer):
    """The rollout server's log-probs of the tokens it sampled, and its prompt log-probs
    (compute_logprobs), against the trainer's forward on the same tokens: both fp32 on
    CPU, different kernels (vLLM's and torch's); they agree to ~1e-6 here, 1e-4 allowed.
    A model whose embedding is padded past its tokenizer too: sampler and trainer score
    the tokenizer's ids only, the prompt's log-probs included."""

    tok = trainer.get_tokenizer()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = tok.encode("copy 314 ->")
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    out = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result()
    assert len(out.sequences) == 4
    for seq in out.sequences:
        got = forward_log_probs(trainer, prompt + list(seq.tokens))[len(prompt) - 1 :]
        np.testing.assert_allclose(seq.logprobs, got, atol=1e-4)
    tokens = prompt + list(out.sequences[0].tokens)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], forward_log_probs(trainer, tokens), atol=1e-4)


def test_the_client_polls_again_while_a_result_is_not_ready(trainer, monkeypatch):
    """retrieve_future answers try_again when a result takes longer than its wait (here
    1 ms, 20 s in service): the client polls again and gets the result, as against the
    hosted service."""
    from polyrl.service import app

    answers = []
    monkeypatch.setattr(app, "POLL_S", 0.001)
    original = app._try_again
    monkeypatch.setattr(app, "_try_again", lambda rid: answers.append(rid) or original(rid))
    tok = trainer.get_tokenizer()
    loss, lps = step(trainer, [datum(tok, "copy 908 -> 908")], lr=0.0)
    assert answers and len(lps) == len(tok.encode("copy 908 -> 908")) - 1 and loss > 0


def test_save_state_then_load_state_continues_exactly(served, trainer):
    """Two steps after save_state, then load_state_with_optimizer and the same two steps:
    the same losses and log-probs, bit for bit (weights and Adam moments restored); so do
    those of a new training client created from the state with its optimizer. Without
    the optimizer (load_state, create_training_client_from_state) the first step's loss is
    the same and the update is a fresh Adam's: the second loss differs, and the two ways
    agree bit for bit."""
    service, url = served
    tok = trainer.get_tokenizer()
    data = [datum(tok, "copy 135 -> 135"), datum(tok, "copy 864 -> 864")]
    path = trainer.save_state("before").result().path
    assert path.startswith("tinker://")
    first = [step(trainer, data, lr=5e-3) for _ in range(2)]
    trainer.load_state_with_optimizer(path).result()
    again = [step(trainer, data, lr=5e-3) for _ in range(2)]
    assert first[1][0] != first[0][0]  # the steps changed the model
    other = tinker.ServiceClient(base_url=url, api_key="tml-local")
    clone = other.create_training_client_from_state_with_optimizer(path).result()
    cloned = [step(clone, data, lr=5e-3) for _ in range(2)]
    for (loss_a, lps_a), *rest in zip(first, again, cloned):
        for loss_b, lps_b in rest:
            assert loss_a == loss_b
            np.testing.assert_array_equal(lps_a, lps_b)
    trainer.load_state(path).result()
    weights_only = [step(trainer, data, lr=5e-3) for _ in range(2)]
    fresh = other.create_training_client_from_state(path).result()
    fresh_steps = [step(fresh, data, lr=5e-3) for _ in range(2)]
    assert weights_only[0][0] == first[0][0] and weights_only[1][0] != first[1][0]
    assert [loss for loss, _ in fresh_steps] == [loss for loss, _ in weights_only]
    assert fresh.get_info().lora_rank == 8
    other.close("success").result()
    assert clone.model_id not in service.models


def test_named_sampler_weights_and_the_base_model_sample(served, client, trainer):
    """save_weights_for_sampler(name) writes an HF directory a new sampling client reads;
    the base model's client samples the untrained weights: the pool swaps between them."""
    tok = trainer.get_tokenizer()
    tokens = tok.encode("copy 271 -> 271")
    saved = trainer.save_weights_for_sampler("named").result().path
    named = client.create_sampling_client(model_path=saved).result()
    base = client.create_sampling_client(base_model=served[0].name).result()
    trained = forward_log_probs(trainer, tokens)
    for _ in range(2):  # back and forth: each call pushes its weights first
        lp_named = named.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
        lp_base = base.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
        np.testing.assert_allclose(lp_named, trained, atol=1e-4)
        assert np.abs(np.asarray(lp_base) - trained).max() > 1e-2


def test_the_base_model_is_named_by_its_directory_in_any_spelling(served, client):
    """A tinker-cookbook recipe's model_name is the directory its tokenizer loads from,
    spelled as the user typed it: relative, with a trailing '/', through '..'. Each names
    the served model (a sampling client on it samples); another directory does not."""
    import os

    service, _ = served
    directory = str(service.model_path)
    spellings = [
        os.path.relpath(directory),
        directory + "/",
        os.path.join(directory, "..", os.path.basename(directory)),
    ]
    prompt = types.ModelInput.from_ints([2, 5, 6])
    for spelling in spellings:
        assert spelling != directory
        sampler = client.create_sampling_client(base_model=spelling).result()
        out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
        assert len(out.sequences[0].tokens) >= 1, spelling
    with pytest.raises(tinker.BadRequestError, match="base_model="):
        client.create_sampling_client(base_model=os.path.dirname(directory)).result()


def test_two_clients_at_once_train_their_own_models(served, trainer):
    """A second session's model starts from the base weights (not the first's), and both
    train side by side: requests of both in flight before either is awaited. The first
    model takes a step of its own first, so that the two differ however many steps the
    tests before this one gave it (it stands alone: -k two_clients)."""
    service, url = served
    tok = trainer.get_tokenizer()
    tokens = tok.encode("copy 555 -> 555")
    data = [datum(tok, "copy 555 -> 555")]
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    other_client = tinker.ServiceClient(base_url=url, api_key="tml-local")
    other = other_client.create_lora_training_client(base_model=service.name, rank=4).result()
    base = other_client.create_sampling_client(base_model=service.name).result()
    lp_base = base.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
    np.testing.assert_allclose(lp_base, forward_log_probs(other, tokens), atol=1e-4)
    # (1e-2: a step of lr 1e-2 moves these log-probs by more; two states a tolerance apart)
    assert np.abs(np.asarray(lp_base) - forward_log_probs(trainer, tokens)).max() > 1e-2
    futures = [
        (
            c.forward_backward(data, "cross_entropy"),
            c.optim_step(types.AdamParams(learning_rate=1e-2)),
        )
        for c in (trainer, other)
    ]
    losses = [fb.result().metrics["loss:sum"] for fb, opt in futures]
    assert all(opt.result().metrics["lr:mean"] == 1e-2 for _, opt in futures)
    assert losses[0] != losses[1]  # two models, two states
    assert info_rank(other) == 4 and info_rank(trainer) == 8
    # closing a client's session ends its models (their workers), not the other's
    other_client.close("success").result()
    assert other.model_id not in service.models and trainer.model_id in service.models


def test_training_clients_share_the_actors_pool_and_one_too_many_is_refused(served, trainer):
    """Each training client's workers ask Ray for 1/max_training_clients of the actor's
    share of its pool: the default pool's 2 CPUs hold the actor's worker and the rollout
    server (1 CPU each), over the default 4 clients: 0.25 CPU and no GPU. Once 4 models
    run, a fifth is refused at arrival by the knob's name, and the service goes on."""
    import ray

    service, url = served
    other_client = tinker.ServiceClient(base_url=url, api_key="tml-local")
    free = 4 - len(service.models)
    assert free >= 1, service.models
    made = [
        other_client.create_lora_training_client(base_model=service.name, rank=2).result()
        for _ in range(free)
    ]
    worker = service.models[made[0].model_id].group.workers[0]
    assigned = ray.get(
        worker.__ray_call__.remote(lambda _: ray.get_runtime_context().get_assigned_resources())
    )
    assert assigned == {"CPU": 0.25}, assigned
    with pytest.raises(tinker.BadRequestError, match="TinkerConfig.max_training_clients=4"):
        other_client.create_lora_training_client(base_model=service.name, rank=2).result()
    other_client.close("success").result()
    assert all(m.model_id not in service.models for m in made)
    # the closed session's slots serve new clients
    fresh = tinker.ServiceClient(base_url=url, api_key="tml-local")
    last = fresh.create_lora_training_client(base_model=service.name, rank=2).result()
    assert last.model_id in service.models
    fresh.close("success").result()


def test_old_snapshots_are_dropped_by_name_while_new_ones_sample(served, trainer):
    """An RL loop makes a weight snapshot a round; the service keeps the newest
    KEEP_SNAPSHOTS. A sampling client whose snapshot went is refused, naming it, once the
    rollout servers hold other weights; the newest still samples."""
    from polyrl.service.state import KEEP_SNAPSHOTS

    prompt = types.ModelInput.from_ints(trainer.get_tokenizer().encode("copy 1"))
    params = types.SamplingParams(max_tokens=2)
    samplers = [
        trainer.save_weights_and_get_sampling_client().result() for _ in range(KEEP_SNAPSHOTS + 1)
    ]
    assert len(samplers[-1].sample(prompt, 1, params).result().sequences) == 1
    with pytest.raises(Exception, match="were dropped"):
        samplers[0].sample(prompt, 1, params).result()
    assert len(samplers[1].sample(prompt, 1, params).result().sequences) == 1


def info_rank(training_client) -> int:
    return training_client.get_info().lora_rank


def test_rest_reads_a_runs_metadata_and_deletes_its_checkpoints(served):
    """The REST calls a tinker-cookbook loop makes: get_training_run_by_tinker_path (the
    renderer name it trained with, read back before it resumes) and
    delete_checkpoint_from_tinker_path (rolling saves). Other REST routes get the
    client's error shape naming the route."""
    service, url = served
    client = tinker.ServiceClient(base_url=url, api_key="tml-local")
    tc = client.create_lora_training_client(
        base_model=service.name, rank=2, user_metadata={"renderer_name": "qwen3_instruct"}
    ).result()
    first = tc.save_state("first").result().path
    second = tc.save_state("second").result().path
    named = tc.save_weights_for_sampler("for-sampling").result().path
    rest = tinker.RestClient(base_url=url, api_key="tml-local")
    run = rest.get_training_run_by_tinker_path(first).result()
    assert run.training_run_id == tc.model_id and run.base_model == service.name
    assert run.user_metadata == {"renderer_name": "qwen3_instruct"} and run.lora_rank == 2
    assert run.last_checkpoint.tinker_path == second
    assert run.last_sampler_checkpoint.tinker_path == named
    rest.delete_checkpoint_from_tinker_path(second).result()
    assert not service.local(second).exists() and service.local(first).exists()
    again = rest.get_training_run(tc.model_id).result()
    assert again.last_checkpoint.tinker_path == first
    with pytest.raises(tinker.BadRequestError, match="names no checkpoint"):
        rest.delete_checkpoint_from_tinker_path(second).result()
    with pytest.raises(tinker.BadRequestError, match="is no checkpoint name"):
        rest.delete_checkpoint(tc.model_id, "weights/.hidden").result()
    with pytest.raises(tinker.BadRequestError, match="names no training run"):
        rest.get_training_run("session-nope:train:0").result()
    with pytest.raises(tinker.NotFoundError, match="GET /api/v1/training_runs is not served"):
        rest.list_training_runs().result()
    client.close("success").result()


def test_malformed_requests_get_the_clients_error_shape_and_the_service_goes_on(served, trainer):
    import httpx

    service, url = served
    post = lambda path, **kw: httpx.post(url + path, timeout=30, **kw)  # noqa: E731
    session = next(iter(service.sessions))

    def model(session_id: str, base_model: str) -> dict:
        lora = {"rank": 4}
        return {
            "session_id": session_id,
            "model_seq_id": 99,
            "base_model": base_model,
            "lora_config": lora,
        }

    cases = [
        (post("/api/v1/create_model", content=b"{not json"), "no JSON"),
        (post("/api/v1/create_model", json={"session_id": "s"}), "model_seq_id"),
        (post("/api/v1/forward_backward", content=b"\xff\x00junk"), "ForwardBackwardRequest"),
        (
            post("/api/v1/optim_step", json={"model_id": "nope", "adam_params": {}}),
            "model_id='nope'",
        ),
        (post("/api/v1/retrieve_future", json={"request_id": "req-x"}), "req-x"),
        (post("/api/v1/create_model", json=model("nope", service.name)), "session_id='nope'"),
        (post("/api/v1/create_model", json=model(session, "Qwen/Qwen3-8B")), "base_model="),
    ]
    for response, field in cases:
        assert response.status_code in (400, 404), response.text
        assert field in response.json()["error"] and response.json()["category"] == "user"
    tok = trainer.get_tokenizer()
    ids = tok.encode("copy 12 -> 12")
    shifted = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[:-1], "weights": [1.0] * (len(ids) - 1)},
    )
    sampler = trainer.save_weights_and_get_sampling_client().result()
    long = types.ModelInput.from_ints([5] * 200)
    with pytest.raises(Exception, match="max_model_len"):
        sampler.sample(long, 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(Exception, match="stop strings"):
        sampler.sample(
            types.ModelInput.from_ints(ids), 1, types.SamplingParams(max_tokens=2, stop=["x"])
        ).result()
    # last: a client whose request failed refuses further requests (the client's rule)
    with pytest.raises(Exception, match="shifted by one"):
        trainer.forward_backward([shifted], "cross_entropy").result()
    assert httpx.get(url + "/api/v1/healthz").json() == {"status": "ok"}
    fresh = tinker.ServiceClient(base_url=url, api_key="tml-local")
    again = fresh.create_lora_training_client(base_model=service.name, rank=2).result()
    with pytest.raises(Exception, match="loss_fn='dro'"):
        again.forward_backward([datum(tok, "copy 1 -> 1")], "dro").result()
    fresh.close("success").result()


@pytest.mark.slow  # ~1 min: 12 rounds of sampling and training
def test_rl_loop_raises_the_copy_reward(served, client):
    """The hosted service's RL loop as tinker-cookbook writes it: sample from the current
    weights, score, importance_sampling forward_backward with group-centred advantages,
    optim_step, a new sampler. The copy task's reward rises."""
    from polyrl.rewards.rules import positional_match

    tc = client.create_lora_training_client(base_model=served[0].name, rank=16).result()
    tok = tc.get_tokenizer()
    prompts = copy_prompts(tok, 8)
    params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[tok.eos_token_id])
    rewards = []
    for _ in range(12):
        sampler = tc.save_weights_and_get_sampling_client().result()
        outs = [sampler.sample(types.ModelInput.from_ints(p), 8, params) for p, _ in prompts]
        data, round_rewards = [], []
        for (prompt, answer), out in zip(prompts, (o.result() for o in outs)):
            scores = [
                positional_match(tok.decode(s.tokens, skip_special_tokens=True), answer)
                for s in out.sequences
            ]
            round_rewards += scores
            for seq, score in zip(out.sequences, scores):
                tokens = prompt + list(seq.tokens)
                n = len(prompt) - 1
                advantage = score - float(np.mean(scores))
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "logprobs": [0.0] * n + list(seq.logprobs),
                            "advantages": [0.0] * n + [advantage] * len(seq.tokens),
                        },
                    )
                )
        rewards.append(float(np.mean(round_rewards)))
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    print("rewards", rewards)
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.1, rewards
