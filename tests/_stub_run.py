"""What ``DPSVI.run`` returns, without the run: a twin's fit without its mechanism."""

from d3p import accounting, minibatch
from d3p.svi import DPSVIRunResult


def stub_result(svi, init_state, losses, num_records, num_steps, *, q, batch_size, sampling, target_delta):
    """A :class:`DPSVIRunResult` holding the parameters of ``init_state`` and
    ``losses``, accounted as ``svi.run`` accounts ``num_steps`` steps of
    ``sampling`` (``"poisson"`` with ``q``, else fixed-size batches of
    ``batch_size``) from ``num_records`` records."""
    sampler = (minibatch.PoissonSampler(num_records, q) if sampling == "poisson"
               else minibatch.FixedSizeSampler(num_records, batch_size))
    res = DPSVIRunResult(svi.get_params(init_state), init_state, losses)
    res.epsilon = accounting.compute_epsilon(svi.dp_scale, sampler.q, num_steps, target_delta,
                                             relation=sampler.relation)
    res.delta, res.relation, res.sigma = target_delta, sampler.relation, svi.dp_scale
    res.q, res.num_steps = sampler.q, num_steps
    return res
