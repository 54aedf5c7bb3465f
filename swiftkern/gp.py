"""A small Gaussian-process surrogate for the layer-set search (float64 torch, no extra deps).

Matern nu = 5/2 kernel with one length scale, signal variance and observation noise; targets
normalized to zero mean and unit variance; hyper-parameters fitted by maximizing the log
marginal likelihood over a fixed log-spaced grid (deterministic, and robust with the few tens
to hundreds of points a search produces). Acquisition: upper confidence bound (SWIFT's, kappa
2.5) or expected improvement.
"""

from __future__ import annotations

import math

import torch

LENGTH_SCALES = tuple(math.exp(x) for x in torch.linspace(math.log(0.3), math.log(30.0), 13, dtype=torch.float32).tolist())
SIGNAL_VARIANCES = (0.25, 1.0, 4.0)
NOISE_VARIANCES = (1e-4, 1e-3, 1e-2, 1e-1, 0.5)


def matern52(a: torch.Tensor, b: torch.Tensor, length_scale: float, signal_var: float) -> torch.Tensor:
    """k(a_i, b_j) = s (1 + sqrt5 r + 5 r^2 / 3) exp(-sqrt5 r), r = |a_i - b_j| / l.
    a: [n, d], b: [m, d] -> [n, m]"""
    r = torch.cdist(a, b) / length_scale
    s5r = math.sqrt(5.0) * r
    return signal_var * (1.0 + s5r + s5r * s5r / 3.0) * torch.exp(-s5r)


class GaussianProcess:
    """GP regression. ``fit(x [n, d], y [n])`` normalizes y and, unless hyper-parameters were
    given, picks (length_scale, signal_var, noise_var) on the grid with the highest log
    marginal likelihood; ``predict(x [m, d]) -> (mean [m], std [m])`` in the units of y."""

    def __init__(self, length_scale: float | None = None, signal_var: float | None = None,
                 noise_var: float | None = None):
        self.fixed = (length_scale, signal_var, noise_var)
        self.length_scale, self.signal_var, self.noise_var = length_scale, signal_var, noise_var
        self.x = None

    def _solve(self, x, y, length_scale, signal_var, noise_var):
        K = matern52(x, x, length_scale, signal_var) + noise_var * torch.eye(len(x), dtype=x.dtype)
        L = torch.linalg.cholesky(K)
        alpha = torch.cholesky_solve(y.unsqueeze(1), L).squeeze(1)
        lml = -0.5 * float(y @ alpha) - float(torch.log(torch.diagonal(L)).sum()) - 0.5 * len(x) * math.log(2 * math.pi)
        return L, alpha, lml

    def fit(self, x: torch.Tensor, y: torch.Tensor, hyper: tuple | None = None) -> "GaussianProcess":
        """hyper: (length_scale, signal_var, noise_var) to reuse instead of the grid search."""
        x = x.to(torch.float64)
        y = y.to(torch.float64)
        if x.dim() != 2 or y.shape != (x.shape[0],) or x.shape[0] == 0:
            raise ValueError(f"GP.fit needs x [n, d] and y [n] with n >= 1, got {tuple(x.shape)}, {tuple(y.shape)}")
        self.y_mean = float(y.mean())
        self.y_std = float(y.std()) if len(y) > 1 and float(y.std()) > 0 else 1.0
        yn = (y - self.y_mean) / self.y_std
        grid = [hyper] if hyper is not None else [
            (ls, sv, nv) for ls in ([self.fixed[0]] if self.fixed[0] is not None else LENGTH_SCALES)
            for sv in ([self.fixed[1]] if self.fixed[1] is not None else SIGNAL_VARIANCES)
            for nv in ([self.fixed[2]] if self.fixed[2] is not None else NOISE_VARIANCES)]  # 0.0 is a value
        best = None
        for ls, sv, nv in grid:
            L, alpha, lml = self._solve(x, yn, ls, sv, nv)
            if best is None or lml > best[0]:
                best = (lml, ls, sv, nv, L, alpha)
        self.log_marginal_likelihood, self.length_scale, self.signal_var, self.noise_var, self._L, self._alpha = best
        self.x = x
        return self

    @property
    def hyper(self) -> tuple:
        return self.length_scale, self.signal_var, self.noise_var

    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.x is None:
            raise ValueError("GP.predict before fit")
        x = x.to(torch.float64)
        ks = matern52(self.x, x, self.length_scale, self.signal_var)  # [n, m]
        mean = ks.T @ self._alpha
        v = torch.cholesky_solve(ks, self._L)  # K^-1 ks
        var = (self.signal_var - (ks * v).sum(0)).clamp_min(1e-12)
        return mean * self.y_std + self.y_mean, var.sqrt() * self.y_std


def upper_confidence_bound(mean: torch.Tensor, std: torch.Tensor, kappa: float = 2.5) -> torch.Tensor:
    return mean + kappa * std


def expected_improvement(mean: torch.Tensor, std: torch.Tensor, best: float, xi: float = 0.0) -> torch.Tensor:
    """E[max(f - best - xi, 0)] under N(mean, std^2)."""
    z = (mean - best - xi) / std
    normal = torch.distributions.Normal(torch.zeros_like(z), torch.ones_like(z))
    return (mean - best - xi) * normal.cdf(z) + std * torch.exp(normal.log_prob(z))
