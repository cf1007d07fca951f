/**
 * fluksio_nb in JupyterLab: a status-bar item and a sidebar panel, both fed
 * by one poll of the server extension's snapshot.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { IStatusBar } from '@jupyterlab/statusbar';

import { MachineModel } from './model';
import { MachinePanel } from './panel';
import { MachineStatus } from './status';

const OPEN = 'fluksio-nb:open';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'fluksio-nb:plugin',
  description: "The machine's shares: a status-bar item and a panel of every kernel's claims.",
  autoStart: true,
  optional: [IStatusBar, ILayoutRestorer, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null
  ) => {
    const model = new MachineModel();
    const panel = new MachinePanel(model, path => {
      void app.commands.execute('docmanager:open', { path });
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
