/**
 * Tracebacks as JupyterLab and Notebook 7 render them, made readable: every
 * error output (a claimed cell's, and a plain cell's too) goes through the
 * app's own renderer, then through two fixes of what that renderer leaves.
 *
 * Links to nowhere: the renderer takes anything that matches its path pattern
 * for a path, and that pattern matches a lone "/" (the division in
 * `return a / 0`). It wraps each in an `<a>`, then finds no file there and
 * leaves the anchor without an href: an empty link in the page. An anchor whose
 * text has no letter or digit (only slashes, dots, tildes, a line number's
 * colon) cannot be a file's path, so it goes back to plain text; a real path
 * (`~/mod.py:3`) stays a link.
 *
 * Colours the stylesheet cannot reach: 256-colour and 24-bit codes (IPython's
 * keywords are colour 28) come as an inline `color`, which no stylesheet rule
 * outranks. Each such colour moves into custom properties, with a darker and a
 * lighter shade of the same hue that read at 5:1 on the light and the dark
 * theme's error background; style/base.css draws the one of the theme in use,
 * and follows the theme when the user switches it.
 *
 * The wrapper replaces the stderr factory of the app's registry as the app
 * starts, before any notebook (restored ones too) clones that registry.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';

const STDERR = 'application/vnd.jupyter.stderr';

/** No letter, digit or underscore: punctuation, not a file's name. */
const NOT_A_PATH = /^[^\w]*$/;

/**
 * The most a light theme's shade may shine, and the least a dark theme's may:
 * relative luminances that read at 5:1 on the light theme's error background
 * (#fdd, 0.777) and on the dark theme's (its red veil over #212121, 0.040).
 */
const LIGHT_MOST = (0.777 + 0.05) / 5 - 0.05;
const DARK_LEAST = 5 * (0.04 + 0.05) - 0.05;

/** WCAG's relative luminance of an sRGB colour, channels 0-255. */
function luminance(rgb: number[]): number {
  const [r, g, b] = rgb.map(v => {
    v /= 255;
    return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
  });
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}

/**
 * ``rgb`` mixed with black (``towards`` 0) or white (255), no more than it
 * takes to reach ``enough``: the same hue, darker or lighter.
 */
function shade(rgb: number[], towards: number, enough: (y: number) => boolean): string {
  let mixed = rgb;
  for (let part = 0; part <= 1 && !enough(luminance(mixed)); part += 0.02) {
    mixed = rgb.map(v => Math.round(v + (towards - v) * part));
  }
  return `rgb(${mixed.join(', ')})`;
}

/** Put each anchor that cannot name a file back as its text. */
export function unlinkPunctuation(node: HTMLElement): void {
  for (const anchor of Array.from(node.querySelectorAll('a'))) {
    if (NOT_A_PATH.test(anchor.textContent ?? '')) {
      anchor.replaceWith(...Array.from(anchor.childNodes));
    }
  }
  node.normalize();
}

/**
 * Move each inline text colour into custom properties, with its shades, where
 * the stylesheet can reach them. A span with a background of its own (IPython
 * 9's marked expression) keeps its colour: it is drawn against that
 * background, not the error background.
 */
export function shadeableColours(node: HTMLElement): void {
  for (const span of Array.from(node.querySelectorAll<HTMLElement>('pre span[style]'))) {
    const colour = span.style.color;
    const ownBackground = span.style.backgroundColor || /-bg\b/.test(span.className);
    if (!colour || ownBackground) {
      continue;
    }
    const rgb = /^rgb\((\d+), (\d+), (\d+)\)$/.exec(colour);
    if (!rgb) {
      continue;
    }
    const channels = rgb.slice(1).map(Number);
    span.style.removeProperty('color');
    span.style.setProperty('--fluksio-ansi-colour', colour);
    span.style.setProperty('--fluksio-ansi-light', shade(channels, 0, y => y <= LIGHT_MOST));
    span.style.setProperty('--fluksio-ansi-dark', shade(channels, 255, y => y >= DARK_LEAST));
    span.dataset.fluksioColour = '';
  }
}

/** The stderr factory, with both fixes after the original renderer's. */
export function readableErrorFactory(
  original: IRenderMime.IRendererFactory
): IRenderMime.IRendererFactory {
  return {
    ...original,
    createRenderer: options => {
      const renderer = original.createRenderer(options);
      const renderModel = renderer.renderModel.bind(renderer);
      renderer.renderModel = async model => {
        await renderModel(model);
        unlinkPunctuation(renderer.node);
        shadeableColours(renderer.node);
      };
      return renderer;
    }
  };
}

/** Wrap the registry's stderr renderer, once. */
export function readableErrors(rendermime: IRenderMimeRegistry): void {
  const original = rendermime.getFactory(STDERR);
  if (!original) {
    return;
  }
  rendermime.addFactory(readableErrorFactory(original), rendermime.getRank(STDERR));
}

/**
 * A plugin of its own, so that it needs the registry while the rest of the
 * extension runs without one.
 */
export const errorsPlugin: JupyterFrontEndPlugin<void> = {
  id: 'fluksio-nb:errors',
  description: 'Tracebacks readable in light and dark themes, with no links to nowhere.',
  autoStart: true,
  requires: [IRenderMimeRegistry],
  activate: (_app: JupyterFrontEnd, rendermime: IRenderMimeRegistry) => {
    readableErrors(rendermime);
  }
};
