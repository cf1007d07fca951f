/**
 * fluksio_nb in JupyterLab and Notebook 7: a status-bar item, a sidebar
 * panel, and notices when the user's claims start or end, all fed by one
 * poll of the server extension. The notices follow the extension's settings
 * (schema/plugin.json), read through the setting registry, and change as
 * soon as the user changes them.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';

import { MachineModel } from './model';
import { Notices, noticeSettings } from './notices';
import { MachinePanel } from './panel';
import { MachineStatus } from './status';

const OPEN = 'fluksio-nb:open';

const PLUGIN = 'fluksio-nb:plugin';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN,
  description:
    "The machine's shares: a status-bar item, a panel of every kernel's claims, " +
    'and notices when your claims start or end.',
  autoStart: true,
  optional: [IStatusBar, ILayoutRestorer, ICommandPalette, ISettingRegistry],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    settings: ISettingRegistry | null
  ) => {
    const model = new MachineModel();
    const openNotebook = (path: string) => {
      void app.commands.execute('docmanager:open', { path });
    };
    const panel = new MachinePanel(model, openNotebook);
    // The notebook the person works in: the notices of its claims' ends can wait.
    const frontPath = () =>
      (app.shell.currentWidget as { context?: { path?: string } } | null)?.context?.path ?? null;
    const notices = new Notices(model, openNotebook, frontPath);
    settings
      ?.load(PLUGIN)
      .then(loaded => {
        const read = () => {
          notices.settings = noticeSettings(loaded.composite as Record<string, unknown>);
        };
        read();
        loaded.changed.connect(read);
      })
      .catch(reason => {
        // The defaults stand; the console says why the user's own were not read.
        console.warn(`fluksio-nb: could not read the settings, using the defaults: ${reason}`);
      });
    app.shell.add(panel, 'left', { rank: 900 });
    restorer?.add(panel, panel.id);

    app.commands.addCommand(OPEN, {
      label: "Show the Machine's Shares",
      execute: () => {
        app.shell.activateById(panel.id);
        void model.refresh();
      }
    });
    palette?.addItem({ command: OPEN, category: 'fluksio' });

    statusBar?.registerStatusItem(OPEN, {
      item: new MachineStatus(model, () => void app.commands.execute(OPEN)),
      align: 'left',
      rank: 100
    });
  }
};

export default plugin;
