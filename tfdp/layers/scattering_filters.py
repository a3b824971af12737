"""The Morlet filter bank of the 2D scattering transform, in Fourier.

The filters are the ones kymatio 0.3.0 builds (`kymatio.scattering2d.
filter_bank`), so that `tfdp.layers.Scattering2D` reproduces its
coefficients: Gabor and Morlet filters sampled on the padded image grid and
summed over the 5 x 5 neighbouring periods (periodic boundary), taken to
Fourier, kept real (their imaginary part is zero up to rounding), and
periodized to coarser grids for the subsampled layers of the transform.

Example:

>>> bank = filter_bank(36, 36, J=2, L=8)
>>> len(bank.psi), bank.psi[1][0].shape, [p.shape for p in bank.phi]
(2, (8, 36, 36), [(36, 36), (18, 18)])
"""

import dataclasses

import numpy as np

# kymatio normalizes its Gaussians with 2 * 3.1415 (not pi); kept so that the
# filters match it to float precision.
_KYMATIO_PI = 3.1415


@dataclasses.dataclass(frozen=True)
class FilterBank:
    """Fourier-domain filters of a scattering transform with scales J, angles L.

    Attributes:
        psi: list over scales j of lists over resolutions res (0 <= res <= j,
            those the transform uses) of float arrays [L, M / 2^res, N / 2^res]:
            the L wavelets of scale j (angle index theta on axis 0),
            periodized to resolution res.
        phi: list over resolutions res = 0..J-1 of float arrays
            [M / 2^res, N / 2^res]: the low-pass filter.
    """

    psi: list
    phi: list


def gabor_2d(M, N, sigma, theta, xi, slant=1.0):
    """A Gabor filter on the periodic M x N grid, in space (complex [M, N]).

    g(u) = exp(-u^T A u + i xi (u_0 cos theta + u_1 sin theta)) / (2 pi sigma^2
    / slant), A = R diag(1, slant^2) R^T / (2 sigma^2), summed over the shifts
    u + (a M, b N) with a, b in -2..2.
    """
    c, s = np.cos(theta), np.sin(theta)
    rotation = np.array([[c, -s], [s, c]])
    curvature = rotation @ np.diag([1.0, slant**2]) @ rotation.T / (2 * sigma**2)
    periods = np.arange(-2, 3)
    xx = (np.arange(M)[None, :] + M * periods[:, None])[:, :, None, None]
    yy = (np.arange(N)[None, :] + N * periods[:, None])[None, None, :, :]
    exponent = -(
        curvature[0, 0] * xx * xx
        + (curvature[0, 1] + curvature[1, 0]) * xx * yy
        + curvature[1, 1] * yy * yy
    ) + 1j * xi * (xx * c + yy * s)
    return np.exp(exponent).sum(axis=(0, 2)) / (2 * _KYMATIO_PI * sigma**2 / slant)


def morlet_2d(M, N, sigma, theta, xi, slant=0.5):
    """A Morlet filter: a Gabor filter minus the multiple of its envelope that
    makes its sum exactly zero (complex [M, N], in space)."""
    wave = gabor_2d(M, N, sigma, theta, xi, slant)
    envelope = gabor_2d(M, N, sigma, theta, 0.0, slant)
    return wave - wave.sum() / envelope.sum() * envelope


def periodize(spectrum, res):
    """The spectrum [M, N] of a signal subsampled by 2^res: the frequencies of
    the middle band (above the coarse grid's Nyquist) are dropped, the rest
    folded onto the [M / 2^res, N / 2^res] grid by summation."""
    M, N = spectrum.shape
    k = 2**res
    kept = spectrum.copy()
    start_x, len_x = int(M * 2 ** (-res - 1)), int(M * (1 - 2 ** (-res)))
    start_y, len_y = int(N * 2 ** (-res - 1)), int(N * (1 - 2 ** (-res)))
    kept[start_x:start_x + len_x, :] = 0
    kept[:, start_y:start_y + len_y] = 0
    return kept.reshape(k, M // k, k, N // k).sum(axis=(0, 2))


def filter_bank(M, N, J, L=8):
    """The filters of a scattering transform on padded M x N images.

    Wavelet (j, theta): Morlet with sigma 0.8 * 2^j, central frequency
    3 pi / 4 / 2^j, slant 4 / L, at angle (L / 2 - 1 - theta) pi / L. Low-pass:
    Gabor with sigma 0.8 * 2^(J - 1) and frequency 0.

    Args:
        M, N: padded image size, multiples of 2^J.
        J: number of scales.
        L: number of angles.

    Returns:
        A `FilterBank` of float32 arrays.
    """
    psi = []
    for j in range(J):
        levels = [[] for _ in range(min(j + 1, max(J - 1, 1)))]
        for theta in range(L):
            angle = (int(L - L / 2 - 1) - theta) * np.pi / L
            wavelet = morlet_2d(M, N, 0.8 * 2**j, angle, 3.0 / 4.0 * np.pi / 2**j, 4.0 / L)
            spectrum = np.real(np.fft.fft2(wavelet))
            for res, level in enumerate(levels):
                level.append(periodize(spectrum, res))
        psi.append([np.stack(level).astype(np.float32) for level in levels])
    low_pass = np.real(np.fft.fft2(gabor_2d(M, N, 0.8 * 2 ** (J - 1), 0.0, 0.0)))
    phi = [periodize(low_pass, res).astype(np.float32) for res in range(J)]
    return FilterBank(psi=psi, phi=phi)
