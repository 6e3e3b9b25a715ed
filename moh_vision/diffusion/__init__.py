"""Gaussian diffusion for DiT / MoH-DiT: schedules, respacing, losses, DDPM/DDIM/DPM-Solver++ samplers, guidance."""
from .gaussian_diffusion import GaussianDiffusion, create_diffusion, uniform_timesteps
from .dpm_solver import dpm_solver_sample, dpm_solver_timesteps
from .guidance import guided_model_fn
from .losses import discretized_gaussian_log_likelihood, mean_flat, normal_kl
from .samplers import SAMPLERS, check_sampler, sample_with
from .schedule import betas_for_alpha_bar, get_named_beta_schedule, respace_betas, space_timesteps

__all__ = ["GaussianDiffusion", "create_diffusion", "uniform_timesteps", "guided_model_fn", "get_named_beta_schedule",
           "betas_for_alpha_bar", "space_timesteps", "respace_betas", "normal_kl",
           "discretized_gaussian_log_likelihood", "mean_flat", "dpm_solver_sample", "dpm_solver_timesteps",
           "SAMPLERS", "check_sampler", "sample_with"]
